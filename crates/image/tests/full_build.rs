//! The whole `build()` of the `base` template into a temporary state dir:
//! checks the caching contract end to end (a second build does nothing and
//! takes under a second; a new agent redoes only the image step, never
//! debootstrap). Runs debootstrap and apt (about two minutes, needs root
//! and the Debian mirror, about 80 s here); it runs in the full suite
//! (`scripts/test`) like every other test.

use std::time::{Duration, Instant};

use shoal_image::{build, current_artifacts, find_template, BuildOptions};

#[test]
fn base_template_builds_once_and_rebuilds_only_what_changed() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "needs root (debootstrap, chroot)"
    );
    let tmp = tempfile::tempdir().unwrap();
    let agent = tmp.path().join("agent");
    std::fs::write(&agent, "#!/bin/sh\necho agent v1\n").unwrap();
    let spec = find_template("base").unwrap();
    let opts = BuildOptions::quiet(tmp.path(), &agent);

    let first = build(&spec, &opts).unwrap();
    for s in &first.steps {
        eprintln!(
            "{:<14} {:>7.1} s cached={} {}",
            s.step,
            s.duration.as_secs_f64(),
            s.cached,
            s.detail
        );
    }
    assert!(first.rootfs.is_file() && first.kernel.is_file() && first.initramfs.is_file());
    assert_eq!(current_artifacts(tmp.path(), "base").unwrap(), first);

    let started = Instant::now();
    let second = build(&spec, &opts).unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "no-op build took {:?}",
        started.elapsed()
    );
    assert_eq!(second, first);
    assert!(second.steps.iter().all(|s| s.cached));

    std::fs::write(&agent, "#!/bin/sh\necho agent v2\n").unwrap();
    let third = build(&spec, &opts).unwrap();
    assert_ne!(third.input_hash, first.input_hash);
    assert_ne!(third.rootfs, first.rootfs);
    let cached: Vec<(&str, bool)> = third
        .steps
        .iter()
        .map(|s| (s.step.as_str(), s.cached))
        .collect();
    assert_eq!(
        cached,
        [
            ("kernel", true),
            ("initramfs", true),
            ("debootstrap", true),
            ("rootfs image", false)
        ]
    );
}
