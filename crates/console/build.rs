//! Embeds every file under `assets/` in the binary: writes a table of
//! `(path, include_bytes!)` for `src/lib.rs` to include.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read assets")
        .map(|e| e.expect("read assets").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, found);
        } else {
            found.push(path);
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = Vec::new();
    walk(&root, &mut files);
    let mut table = String::from("&[\n");
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
        let name = file
            .strip_prefix(&root)
            .expect("under assets")
            .to_str()
            .expect("asset names are UTF-8")
            .replace('\\', "/");
        writeln!(
            table,
            "    ({name:?}, include_bytes!({:?}) as &[u8]),",
            file.display()
        )
        .unwrap();
    }
    table.push(']');
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("assets.rs"), table).expect("write the asset table");
}
