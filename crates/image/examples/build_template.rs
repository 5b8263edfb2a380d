//! Builds one template's artifacts from the command line, with spinners:
//! `cargo run -p shoal-image --example build_template -- <name> <state_dir> <agent>`.
//! A stand-in for `shoal template build` while the CLI is being written.

use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: {} <template> <state_dir> <guest_agent>", args[0]);
        std::process::exit(2);
    }
    let spec = shoal_image::find_template(&args[1]).unwrap_or_else(|| {
        eprintln!("unknown template {}", args[1]);
        std::process::exit(2)
    });
    let opts = shoal_image::BuildOptions {
        state_dir: Path::new(&args[2]),
        guest_agent: Path::new(&args[3]),
        progress: shoal_image::MultiProgress::new(),
    };
    let started = Instant::now();
    match shoal_image::build(&spec, &opts) {
        Ok(a) => {
            for s in &a.steps {
                println!(
                    "{:<14} {:>8.1} s  cached={}  {}",
                    s.step,
                    s.duration.as_secs_f64(),
                    s.cached,
                    s.detail
                );
            }
            println!("total {:.2} s", started.elapsed().as_secs_f64());
            println!(
                "{}",
                serde_json::to_string_pretty(&a).expect("serialisable")
            );
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
