//! Slurm's time formats: reading `--time` values and writing durations the
//! way sacct (`Elapsed`, `CPUTime`, `TotalCPU`) and squeue (`TIME`) show
//! them.
//!
//! Owns: `--time` parsing as Slurm's `time_str2secs` does it (`minutes`,
//! `minutes:seconds`, `hours:minutes:seconds`, `days-hours`,
//! `days-hours:minutes`, `days-hours:minutes:seconds`; `UNLIMITED`,
//! `INFINITE` and `-1` for no limit; and, as sbatch(1) says, `0` for no
//! limit), and the formatters of `secs2time_str`, sacct's `_elapsed_time`
//! and squeue's `TIME` column.
//! May not: enforce limits or read clocks.

use std::time::Duration;

use crate::SlurmError;

/// Parses a `--time` value: `Some(limit)`, or `None` when the job asks for
/// no limit (`UNLIMITED`, `infinite`, `-1`, `0`; case-insensitive).
///
/// The duration is exact; Slurm enforces limits in whole minutes, rounding
/// seconds up (see [`round_up_to_minute`]).
pub fn parse_time_limit(value: &str) -> Result<Option<Duration>, SlurmError> {
    let s = value.trim();
    let invalid = || SlurmError::InvalidTime {
        value: value.to_string(),
    };
    if s.eq_ignore_ascii_case("unlimited") || s.eq_ignore_ascii_case("infinite") || s == "-1" {
        return Ok(None);
    }
    if s.is_empty()
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b':' || b == b'-')
    {
        return Err(invalid());
    }
    let num = |p: &str| -> Result<u64, SlurmError> {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        p.parse::<u64>().map_err(|_| invalid())
    };
    let secs = match s.split_once('-') {
        Some((days, rest)) => {
            // days-hours[:minutes[:seconds]]
            let days = num(days)?;
            let parts: Vec<&str> = rest.split(':').collect();
            if parts.len() > 3 {
                return Err(invalid());
            }
            let hours = num(parts[0])?;
            let minutes = parts.get(1).map(|p| num(p)).transpose()?.unwrap_or(0);
            let seconds = parts.get(2).map(|p| num(p)).transpose()?.unwrap_or(0);
            days * 86_400 + hours * 3_600 + minutes * 60 + seconds
        }
        None => {
            let parts: Vec<&str> = s.split(':').collect();
            match parts.as_slice() {
                [m] => num(m)? * 60,
                [m, sec] => num(m)? * 60 + num(sec)?,
                [h, m, sec] => num(h)? * 3_600 + num(m)? * 60 + num(sec)?,
                _ => return Err(invalid()),
            }
        }
    };
    if secs == 0 {
        // sbatch(1): "A time limit of zero requests that no time limit be imposed."
        return Ok(None);
    }
    Ok(Some(Duration::from_secs(secs)))
}

/// The limit Slurm enforces for a requested duration: "Time resolution is
/// one minute and second values are rounded up to the next minute."
pub fn round_up_to_minute(d: Duration) -> Duration {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    Duration::from_secs(secs.div_ceil(60) * 60)
}

/// sacct's `Elapsed`/`CPUTime`/`Timelimit` form (Slurm's `secs2time_str`):
/// `HH:MM:SS`, or `D-HH:MM:SS` from one day on. Sub-second parts are
/// dropped.
pub fn format_elapsed(d: Duration) -> String {
    let t = d.as_secs();
    let (days, h, m, s) = (t / 86_400, (t / 3_600) % 24, (t / 60) % 60, t % 60);
    if days > 0 {
        format!("{days}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// squeue's `TIME` column: `M:SS` under an hour, `H:MM:SS` under a day,
/// then `D-HH:MM:SS` (a pending job shows `0:00`).
pub fn format_squeue_time(d: Duration) -> String {
    let t = d.as_secs();
    let (days, h, m, s) = (t / 86_400, (t / 3_600) % 24, (t / 60) % 60, t % 60);
    if days > 0 {
        format!("{days}-{h:02}:{m:02}:{s:02}")
    } else if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

/// sacct's `TotalCPU`/`UserCPU` form (its `_elapsed_time`): `D-HH:MM:SS`,
/// `HH:MM:SS` from an hour on, `MM:SS.mmm` below an hour when there are
/// milliseconds, else `00:MM:SS`.
pub fn format_total_cpu(d: Duration) -> String {
    let t = d.as_secs();
    let millis = d.subsec_millis();
    let (days, h, m, s) = (t / 86_400, (t / 3_600) % 24, (t / 60) % 60, t % 60);
    if days > 0 {
        format!("{days}-{h:02}:{m:02}:{s:02}")
    } else if h > 0 {
        format!("{h:02}:{m:02}:{s:02}")
    } else if millis > 0 {
        format!("{m:02}:{s:02}.{millis:03}")
    } else {
        format!("00:{m:02}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(v: &str) -> u64 {
        parse_time_limit(v).unwrap().unwrap().as_secs()
    }

    #[test]
    fn every_format_of_the_manual() {
        assert_eq!(secs("60"), 3_600, "minutes");
        assert_eq!(secs("30:30"), 30 * 60 + 30, "minutes:seconds");
        assert_eq!(
            secs("4:30:30"),
            4 * 3_600 + 30 * 60 + 30,
            "hours:minutes:seconds"
        );
        assert_eq!(secs("00:10:00"), 600);
        assert_eq!(secs("4-12"), 4 * 86_400 + 12 * 3_600, "days-hours");
        assert_eq!(
            secs("4-12:15"),
            4 * 86_400 + 12 * 3_600 + 15 * 60,
            "days-hours:minutes"
        );
        assert_eq!(
            secs("4-12:15:30"),
            4 * 86_400 + 12 * 3_600 + 15 * 60 + 30,
            "days-hours:minutes:seconds"
        );
        assert_eq!(secs("2-02:30:00"), 2 * 86_400 + 2 * 3_600 + 30 * 60);
        assert_eq!(secs("1-00:00:00"), 86_400);
    }

    #[test]
    fn fields_are_not_range_checked_like_slurm() {
        // time_str2secs multiplies each field; 90 minutes is fine.
        assert_eq!(secs("90"), 5_400);
        assert_eq!(secs("0:90:00"), 5_400);
    }

    #[test]
    fn no_limit() {
        for v in [
            "UNLIMITED",
            "unlimited",
            "infinite",
            "INFINITE",
            "-1",
            "0",
            "00:00:00",
            "0-0",
        ] {
            assert_eq!(parse_time_limit(v).unwrap(), None, "{v}");
        }
    }

    #[test]
    fn invalid() {
        for v in [
            "",
            "abc",
            "1:2:3:4",
            "1-2:3:4:5",
            "1-",
            "-5",
            "1h",
            "10m",
            ":",
            "1::2",
            " 1 2 ",
            "1.5",
        ] {
            assert!(
                matches!(parse_time_limit(v), Err(SlurmError::InvalidTime { .. })),
                "{v:?} should be invalid"
            );
        }
    }

    #[test]
    fn rounding_like_slurm() {
        assert_eq!(
            round_up_to_minute(Duration::from_secs(30)),
            Duration::from_secs(60)
        );
        assert_eq!(
            round_up_to_minute(Duration::from_secs(60)),
            Duration::from_secs(60)
        );
        assert_eq!(
            round_up_to_minute(Duration::from_secs(61)),
            Duration::from_secs(120)
        );
        assert_eq!(
            round_up_to_minute(Duration::from_millis(60_001)),
            Duration::from_secs(120)
        );
    }

    #[test]
    fn elapsed_like_secs2time_str() {
        assert_eq!(format_elapsed(Duration::ZERO), "00:00:00");
        assert_eq!(format_elapsed(Duration::from_secs(83)), "00:01:23");
        assert_eq!(
            format_elapsed(Duration::from_secs(3_600 * 23 + 59 * 60 + 59)),
            "23:59:59"
        );
        assert_eq!(format_elapsed(Duration::from_secs(86_400)), "1-00:00:00");
        assert_eq!(
            format_elapsed(Duration::from_secs(12 * 86_400 + 3_723)),
            "12-01:02:03"
        );
        assert_eq!(format_elapsed(Duration::from_millis(1_999)), "00:00:01");
    }

    #[test]
    fn squeue_time() {
        assert_eq!(format_squeue_time(Duration::ZERO), "0:00");
        assert_eq!(format_squeue_time(Duration::from_secs(17)), "0:17");
        assert_eq!(
            format_squeue_time(Duration::from_secs(17 * 60 + 3)),
            "17:03"
        );
        assert_eq!(
            format_squeue_time(Duration::from_secs(4 * 3_600 + 7)),
            "4:00:07"
        );
        assert_eq!(
            format_squeue_time(Duration::from_secs(2 * 86_400 + 5)),
            "2-00:00:05"
        );
    }

    #[test]
    fn total_cpu_like_sacct() {
        assert_eq!(format_total_cpu(Duration::from_millis(1_234)), "00:01.234");
        assert_eq!(format_total_cpu(Duration::from_secs(65)), "00:01:05");
        assert_eq!(
            format_total_cpu(Duration::from_millis(3_600_500)),
            "01:00:00"
        );
        assert_eq!(format_total_cpu(Duration::from_secs(86_401)), "1-00:00:01");
    }
}
