//! First-party template specifications: what a template is made of
//! (packages, disk size) and what the engine should give its VM (memory,
//! vCPUs). Pure data; building lives in the other modules.

use serde::{Deserialize, Serialize};

use crate::error::ImageError;
use crate::rootfs::SUITE;

/// The Debian releases a Dockerfile's `FROM debian:<release>` may name,
/// besides the first-party templates' own ([`SUITE`]): each is bootstrapped
/// on a host the first time a build asks for it, as the template
/// `debian-<release>`.
pub const OTHER_DEBIAN_RELEASES: [&str; 2] = ["bullseye", "trixie"];

/// A template: a name, the VM shape the engine gives it, and the Debian
/// release and packages its root filesystem holds on top of `minbase`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateSpec {
    pub name: String,
    pub memory_mib: u32,
    pub vcpus: u32,
    pub packages: Vec<String>,
    /// Size of the (sparse) root filesystem image: the room a sandbox has.
    pub disk_mib: u32,
    /// The Debian release (`debootstrap`'s suite).
    #[serde(default = "default_suite")]
    pub suite: String,
}

fn default_suite() -> String {
    SUITE.into()
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// The templates Shoal ships.
pub fn first_party_templates() -> Vec<TemplateSpec> {
    vec![
        TemplateSpec {
            name: "base".into(),
            memory_mib: 4096,
            vcpus: 8,
            packages: strings(&["ca-certificates", "iproute2", "procps", "python3-minimal"]),
            disk_mib: 2048,
            suite: SUITE.into(),
        },
        TemplateSpec {
            name: "code-interpreter".into(),
            memory_mib: 2048,
            vcpus: 8,
            // python3-munkres satisfies python3-fonttools' "python3-scipy |
            // python3-munkres": without it apt picks scipy, whose bookworm
            // package drags in pythran, g++ and the boost headers (~600 MB).
            packages: strings(&[
                "ca-certificates",
                "iproute2",
                "procps",
                "python3",
                "python3-matplotlib",
                "python3-munkres",
                "python3-numpy",
                "python3-pandas",
            ]),
            disk_mib: 4096,
            suite: SUITE.into(),
        },
    ]
}

/// The template of another Debian release (`debian-bullseye`,
/// `debian-trixie`): what `base` is, on that release. Not baked at start;
/// a build `FROM debian:<release>` bakes it on its host once.
pub fn release_template(release: &str) -> Option<TemplateSpec> {
    if !OTHER_DEBIAN_RELEASES.contains(&release) {
        return None;
    }
    let base = first_party_templates()
        .into_iter()
        .find(|t| t.name == "base")?;
    Some(TemplateSpec {
        name: format!("debian-{release}"),
        suite: release.into(),
        ..base
    })
}

/// Whether `name` can name a template: 1-63 of `[a-z0-9-]`, not starting
/// with `-` (it is a guest hostname and a directory name).
pub fn valid_template_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

/// The first-party template called `name`, or another release's
/// (`debian-<release>`).
pub fn find_template(name: &str) -> Option<TemplateSpec> {
    first_party_templates()
        .into_iter()
        .find(|t| t.name == name)
        .or_else(|| release_template(name.strip_prefix("debian-")?))
}

impl TemplateSpec {
    /// Checks what the builder relies on: the name is a valid hostname and
    /// directory name, package names are Debian package names, sizes are sane.
    pub fn validate(&self) -> Result<(), ImageError> {
        let bad = |why: String| Err(ImageError::InvalidTemplate(format!("{}: {why}", self.name)));
        if !valid_template_name(&self.name) {
            return bad("name must be 1-63 of [a-z0-9-], not starting with '-'".into());
        }
        for p in &self.packages {
            let ok = p.len() >= 2
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b))
                && p.as_bytes()[0].is_ascii_alphanumeric();
            if !ok {
                return bad(format!("{p:?} is not a Debian package name"));
            }
        }
        if self.suite != SUITE && !OTHER_DEBIAN_RELEASES.contains(&self.suite.as_str()) {
            return bad(format!(
                "{:?} is not a Debian release Shoal bootstraps",
                self.suite
            ));
        }
        if self.disk_mib < 64 {
            return bad(format!("disk_mib {} is below 64", self.disk_mib));
        }
        if self.memory_mib < 128 || self.vcpus == 0 {
            return bad("needs at least 128 MiB and one vCPU".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_party_templates_are_valid_and_findable() {
        for t in first_party_templates() {
            t.validate().unwrap();
            assert_eq!(find_template(&t.name).unwrap(), t);
        }
        let ci = find_template("code-interpreter").unwrap();
        assert_eq!((ci.memory_mib, ci.vcpus), (2048, 8));
        assert!(ci.packages.iter().any(|p| p == "python3-pandas"));
        let base = find_template("base").unwrap();
        assert_eq!((base.memory_mib, base.vcpus), (4096, 8));
        assert!(find_template("nope").is_none());
        let trixie = find_template("debian-trixie").unwrap();
        trixie.validate().unwrap();
        assert_eq!(
            (trixie.suite.as_str(), trixie.packages.clone()),
            ("trixie", base.packages.clone())
        );
        assert!(find_template("debian-bookworm").is_none());
        assert!(find_template("debian-sid").is_none());
    }

    #[test]
    fn validation_rejects_bad_names_and_packages() {
        let mut t = find_template("base").unwrap();
        t.name = "Bad/Name".into();
        assert!(t.validate().is_err());
        let mut t = find_template("base").unwrap();
        t.packages.push("--option".into());
        assert!(t.validate().is_err());
    }
}
