//! Chooses the accelerator: KVM where this host can really run guests with
//! it, TCG otherwise.
//!
//! `/dev/kvm` existing is not enough: on nested PVM hosts it opens, but the
//! CPU has no vmx/svm and a stock kernel dies with emulation failures
//! (see the design notes). So KVM needs both the CPU flag and the device.

use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            other => Err(format!("unknown accelerator {other:?} (kvm or tcg)")),
        }
    }
}

/// Picks KVM when `cpuinfo` shows hardware virtualisation and `kvm_device`
/// opens read-write, TCG otherwise. Takes its roots as arguments so tests can
/// point them at fixtures.
pub fn detect(cpuinfo: &Path, kvm_device: &Path) -> Accel {
    let has_flag = std::fs::read_to_string(cpuinfo)
        .map(|text| cpu_has_virtualisation(&text))
        .unwrap_or(false);
    let opens = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(kvm_device)
        .is_ok();
    if has_flag && opens {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

fn cpu_has_virtualisation(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|line| line.starts_with("flags"))
        .any(|line| {
            line.split_whitespace()
                .any(|flag| flag == "vmx" || flag == "svm")
        })
}

/// The host TSC frequency in kHz, which a TCG guest's TSC runs at. Given to
/// the guest kernel because with several vCPUs under TCG its own PIT
/// calibration fails and boot hangs.
pub fn host_tsc_khz(cpuinfo: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(cpuinfo).ok()?;
    let line = text.lines().find(|l| l.starts_with("cpu MHz"))?;
    let mhz: f64 = line.split(':').nth(1)?.trim().parse().ok()?;
    Some((mhz * 1000.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_decide_virtualisation() {
        assert!(cpu_has_virtualisation("flags\t\t: fpu vme vmx sse\n"));
        assert!(cpu_has_virtualisation("flags\t\t: fpu svm\n"));
        assert!(!cpu_has_virtualisation(
            "flags\t\t: fpu vme sse hypervisor\n"
        ));
    }

    #[test]
    fn kvm_needs_an_openable_device() {
        let dir = std::env::temp_dir().join(format!("shoal-accel-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cpuinfo = dir.join("cpuinfo");
        std::fs::write(&cpuinfo, "flags\t\t: vmx\ncpu MHz\t\t: 2445.426\n").unwrap();
        assert_eq!(detect(&cpuinfo, &dir.join("no-kvm")), Accel::Tcg);
        let fake_kvm = dir.join("kvm");
        std::fs::write(&fake_kvm, "").unwrap();
        assert_eq!(detect(&cpuinfo, &fake_kvm), Accel::Kvm);
        assert_eq!(host_tsc_khz(&cpuinfo), Some(2445426));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
