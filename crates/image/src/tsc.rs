//! The host's TSC frequency, which a TCG guest needs on its command line.
//!
//! Under TCG the guest's `rdtsc` returns the host's TSC, so the guest TSC
//! runs at the host's rate; but the guest kernel's own calibration (against
//! the PIT: microvm has no HPET or ACPI PM timer) fails about half the time
//! on a busy host, after which the 6.1 kernel marks the TSC unstable and
//! hangs at boot. Telling it the rate with `tsc_early_khz=` skips the
//! calibration. Measured here once per process, against CLOCK_MONOTONIC.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

#[cfg(target_arch = "x86_64")]
fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no memory effects and exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(target_arch = "x86_64")]
fn measure_once(window: Duration) -> u64 {
    let (t0, c0) = (Instant::now(), rdtsc());
    std::thread::sleep(window);
    let (c1, t1) = (rdtsc(), Instant::now());
    let nanos = (t1 - t0).as_nanos().max(1);
    (u128::from(c1.wrapping_sub(c0)) * 1_000_000 / nanos) as u64
}

/// The host TSC frequency in kHz, or `None` off x86-64 or if the TSC does
/// not tick. Uses the kernel's value when it exports one, else the median
/// of three 50 ms measurements (good to a few ppm: the error is the time
/// between reading the two clocks, not the window).
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: OnceLock<Option<u64>> = OnceLock::new();
    *KHZ.get_or_init(|| {
        if let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/tsc_freq_khz") {
            if let Ok(khz) = s.trim().parse::<u64>() {
                return Some(khz);
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            let mut samples: Vec<u64> = (0..3)
                .map(|_| measure_once(Duration::from_millis(50)))
                .collect();
            samples.sort_unstable();
            let khz = samples[1];
            (khz > 0).then_some(khz)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_rate_is_plausible_and_stable() {
        let Some(khz) = host_tsc_khz() else { return };
        // Any x86 made this century: 500 MHz to 10 GHz.
        assert!((500_000..10_000_000).contains(&khz), "{khz}");
        #[cfg(target_arch = "x86_64")]
        {
            let again = measure_once(Duration::from_millis(50));
            let diff = again.abs_diff(khz) as f64 / khz as f64;
            assert!(diff < 0.01, "{khz} vs {again}");
        }
    }
}
