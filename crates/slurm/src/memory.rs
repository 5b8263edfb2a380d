//! Memory sizes as `--mem` and `--mem-per-cpu` take them, and as sacct
//! shows a requested size (`ReqMem`).
//!
//! Owns: Slurm's `str_to_mbytes` rules (a whole number, default unit MiB,
//! optional `K`, `M`, `G` or `T` suffix in either case, optionally followed
//! by `B`; kibibytes round up to a whole MiB) and `mbytes_to_str`.
//! May not: decide what a size means for a template (`--mem=0`, "all the
//! node's memory" in Slurm, is returned as 0 for the caller to interpret).

use crate::SlurmError;

/// Parses a `--mem`-style size into MiB: `4G` = 4096, `500M` = 500,
/// `1T` = 1048576, `2048` = 2048, `1536K` = 2 (rounded up), `4GB` = 4096.
pub fn parse_mem_mib(value: &str) -> Result<u64, SlurmError> {
    let invalid = || SlurmError::InvalidMemory {
        value: value.to_string(),
    };
    let s = value.trim();
    let digits_end = s
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(s.len());
    if digits_end == 0 {
        return Err(invalid());
    }
    let n: u64 = s[..digits_end].parse().map_err(|_| invalid())?;
    let suffix = s[digits_end..].to_ascii_uppercase();
    let unit = suffix
        .strip_suffix('B')
        .filter(|u| !u.is_empty())
        .unwrap_or(&suffix);
    let mib = match unit {
        "" if suffix.is_empty() => Some(n),
        "K" => Some(n.div_ceil(1024)),
        "M" => Some(n),
        "G" => n.checked_mul(1024),
        "T" => n.checked_mul(1024 * 1024),
        _ => None,
    };
    mib.ok_or_else(invalid)
}

/// Slurm's `mbytes_to_str`: the largest unit that divides the size exactly
/// (`4096` gives `4G`, `1500` gives `1500M`, `0` gives `0M`).
pub fn format_mem_mib(mib: u64) -> String {
    let units = ['M', 'G', 'T', 'P'];
    let mut n = mib;
    let mut i = 0;
    while n != 0 && n.is_multiple_of(1024) && i + 1 < units.len() {
        n /= 1024;
        i += 1;
    }
    format!("{n}{}", units[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_mem_mib("4G").unwrap(), 4_096);
        assert_eq!(parse_mem_mib("4g").unwrap(), 4_096);
        assert_eq!(parse_mem_mib("500M").unwrap(), 500);
        assert_eq!(parse_mem_mib("1T").unwrap(), 1_048_576);
        assert_eq!(parse_mem_mib("2048").unwrap(), 2_048, "MiB is the default");
        assert_eq!(parse_mem_mib("1024K").unwrap(), 1);
        assert_eq!(parse_mem_mib("1025K").unwrap(), 2, "kibibytes round up");
        assert_eq!(parse_mem_mib("1k").unwrap(), 1);
        assert_eq!(parse_mem_mib("0").unwrap(), 0, "--mem=0 is passed through");
    }

    #[test]
    fn trailing_b_is_accepted_as_slurm_does() {
        assert_eq!(parse_mem_mib("4GB").unwrap(), 4_096);
        assert_eq!(parse_mem_mib("16gb").unwrap(), 16_384);
        assert_eq!(parse_mem_mib("100MB").unwrap(), 100);
    }

    #[test]
    fn invalid() {
        for v in ["", "G", "4.5G", "-1", "4X", "4GiB", "B", "4 G", "4BB", "1E"] {
            assert!(
                matches!(parse_mem_mib(v), Err(SlurmError::InvalidMemory { .. })),
                "{v:?} should be invalid"
            );
        }
        assert!(parse_mem_mib("99999999999999999T").is_err(), "overflow");
        assert!(parse_mem_mib("5B").is_err(), "a bare B is not a unit");
    }

    #[test]
    fn formatting() {
        assert_eq!(format_mem_mib(4_096), "4G");
        assert_eq!(format_mem_mib(1_500), "1500M");
        assert_eq!(format_mem_mib(1_048_576), "1T");
        assert_eq!(format_mem_mib(0), "0M");
        assert_eq!(format_mem_mib(1_536), "1536M");
    }
}
