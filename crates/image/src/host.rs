//! What the builder needs from the host: its tools (installed with apt if
//! missing, because the build must be self-sufficient on a fresh Debian
//! host) and the Debian mirror the host's apt uses.
//!
//! Does not know about layers or templates.

use std::path::Path;
use std::process::Command;

use crate::cmd;
use crate::error::ImageError;
use crate::modules::is_static_elf;

/// Where the initramfs takes busybox from (Debian package `busybox-static`).
pub const BUSYBOX: &str = "/bin/busybox";

/// Mirror used when the host's sources name none for the suite.
const FALLBACK_MIRROR: &str = "http://deb.debian.org/debian";

/// A host tool and the Debian package that provides it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tool {
    pub path_or_name: &'static str,
    pub package: &'static str,
}

pub(crate) const APT_TOOLS: &[Tool] = &[
    Tool {
        path_or_name: "apt-get",
        package: "apt",
    },
    Tool {
        path_or_name: "apt-cache",
        package: "apt",
    },
    Tool {
        path_or_name: "dpkg-deb",
        package: "dpkg",
    },
];
pub(crate) const ROOTFS_TOOLS: &[Tool] = &[
    Tool {
        path_or_name: "debootstrap",
        package: "debootstrap",
    },
    Tool {
        path_or_name: "mkfs.ext4",
        package: "e2fsprogs",
    },
];

fn on_path(name: &str) -> bool {
    if name.contains('/') {
        return Path::new(name).is_file();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        .unwrap_or(false)
        // Root's tools live in sbin, which a user's PATH may omit.
        || ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
            .iter()
            .any(|d| Path::new(d).join(name).is_file())
}

fn busybox_is_usable() -> bool {
    std::fs::read(BUSYBOX)
        .map(|b| is_static_elf(&b))
        .unwrap_or(false)
}

/// Makes sure every tool in `tools` exists (and, if `need_busybox`, that
/// /bin/busybox is the static one), installing missing packages with
/// `apt-get install`. Runs `apt-get update` once if the install fails
/// because the package lists are stale or empty.
pub(crate) fn ensure_tools(tools: &[Tool], need_busybox: bool) -> Result<(), ImageError> {
    let mut packages: Vec<&str> = tools
        .iter()
        .filter(|t| !on_path(t.path_or_name))
        .map(|t| t.package)
        .collect();
    if need_busybox && !busybox_is_usable() {
        packages.push("busybox-static");
    }
    packages.sort_unstable();
    packages.dedup();
    if packages.is_empty() {
        return Ok(());
    }
    tracing::info!(?packages, "installing missing host tools");
    let install = || {
        cmd::run(
            apt_command("apt-get")
                .args(["install", "-y", "--no-install-recommends"])
                .args(&packages),
        )
    };
    if install().is_err() {
        cmd::run(apt_command("apt-get").arg("update"))?;
        install()?;
    }
    if need_busybox && !busybox_is_usable() {
        return Err(ImageError::Host(format!(
            "{BUSYBOX} is not a static binary even after installing busybox-static"
        )));
    }
    Ok(())
}

/// An apt command set up for unattended, parseable use.
pub(crate) fn apt_command(program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("DEBIAN_FRONTEND", "noninteractive")
        .env("LC_ALL", "C");
    c
}

/// The Debian mirror this host's apt uses for `suite`: the first enabled
/// `deb` source (one-line or deb822 format) that lists the suite.
pub fn debian_mirror(suite: &str) -> String {
    let mut texts = Vec::new();
    if let Ok(t) = std::fs::read_to_string("/etc/apt/sources.list") {
        texts.push((false, t));
    }
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<_> = dir.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            let deb822 = p.extension().is_some_and(|e| e == "sources");
            let one_line = p.extension().is_some_and(|e| e == "list");
            if deb822 || one_line {
                if let Ok(t) = std::fs::read_to_string(&p) {
                    texts.push((deb822, t));
                }
            }
        }
    }
    texts
        .iter()
        .find_map(|(deb822, t)| {
            if *deb822 {
                mirror_from_deb822(t, suite)
            } else {
                mirror_from_one_line(t, suite)
            }
        })
        .unwrap_or_else(|| FALLBACK_MIRROR.to_string())
}

/// `deb [opts] URI suite components...` lines.
pub(crate) fn mirror_from_one_line(text: &str, suite: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        if words.next()? != "deb" {
            return None;
        }
        let mut uri = words.next()?;
        if uri.starts_with('[') {
            // Options may contain spaces: skip to the word closing them.
            while !uri.ends_with(']') {
                uri = words.next()?;
            }
            uri = words.next()?;
        }
        (words.next()? == suite).then(|| uri.trim_end_matches('/').to_string())
    })
}

/// deb822 stanzas: `Types: deb`, `URIs: ...`, `Suites: ...`, optional `Enabled: no`.
pub(crate) fn mirror_from_deb822(text: &str, suite: &str) -> Option<String> {
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza.lines().find_map(|l| {
                let l = l.trim();
                if l.starts_with('#') {
                    return None;
                }
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
        };
        let enabled = !matches!(field("Enabled"), Some(v) if v.eq_ignore_ascii_case("no"));
        let is_deb = field("Types")?.split_whitespace().any(|t| t == "deb");
        let has_suite = field("Suites")?.split_whitespace().any(|s| s == suite);
        if !(enabled && is_deb && has_suite) {
            return None;
        }
        field("URIs")?
            .split_whitespace()
            .next()
            .map(|u| u.trim_end_matches('/').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_picks_the_stanza_with_the_suite() {
        let t = "Types: deb\n# http://snapshot.debian.org/x\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        assert_eq!(
            mirror_from_deb822(t, "bookworm").unwrap(),
            "http://deb.debian.org/debian"
        );
        assert_eq!(
            mirror_from_deb822(t, "bookworm-security").unwrap(),
            "http://deb.debian.org/debian-security"
        );
        assert!(mirror_from_deb822(t, "trixie").is_none());
        let disabled = "Enabled: no\nTypes: deb\nURIs: http://x/debian\nSuites: bookworm\n";
        assert!(mirror_from_deb822(disabled, "bookworm").is_none());
    }

    #[test]
    fn one_line_format_with_and_without_options() {
        let t = "# deb http://old bookworm main\ndeb-src http://src bookworm main\ndeb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n";
        assert_eq!(
            mirror_from_one_line(t, "bookworm").unwrap(),
            "http://mirror.example/debian"
        );
        assert!(mirror_from_one_line("deb http://a/debian bullseye main", "bookworm").is_none());
    }

    #[test]
    fn host_mirror_is_a_url() {
        assert!(debian_mirror("bookworm").starts_with("http"));
    }
}
