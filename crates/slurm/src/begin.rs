//! `--begin`: when a job may start, in the forms sbatch takes.
//!
//! `now[+N[units]]` (units `seconds` (default), `minutes`, `hours`, `days`,
//! `weeks`, singular or plural), `HH:MM[:SS]` (today, or tomorrow once that
//! time has passed), `YYYY-MM-DD[THH:MM[:SS]]`, `MM/DD[/YY]`, and the words
//! `midnight`, `noon`, `fika` (15:00), `teatime` (16:00), `today` and
//! `tomorrow`, all in the submitting machine's local time.

use chrono::{DateTime, Duration, Local, NaiveDate, NaiveDateTime, NaiveTime, TimeZone};

use crate::SlurmError;

fn invalid(value: &str, reason: &str) -> SlurmError {
    SlurmError::InvalidCount {
        value: value.to_owned(),
        reason: format!("--begin {reason}"),
    }
}

/// The local time of `date` at `time` (the earlier of a repeated hour).
fn local(value: &str, date: NaiveDate, time: NaiveTime) -> Result<DateTime<Local>, SlurmError> {
    Local
        .from_local_datetime(&NaiveDateTime::new(date, time))
        .earliest()
        .ok_or_else(|| invalid(value, "names a time that does not exist here"))
}

/// The next time of day `time` at or after `now`.
fn next_at(
    value: &str,
    now: DateTime<Local>,
    time: NaiveTime,
) -> Result<DateTime<Local>, SlurmError> {
    let today = local(value, now.date_naive(), time)?;
    if today >= now {
        Ok(today)
    } else {
        local(value, now.date_naive() + Duration::days(1), time)
    }
}

fn time_of_day(text: &str) -> Option<NaiveTime> {
    NaiveTime::parse_from_str(text, "%H:%M:%S")
        .or_else(|_| NaiveTime::parse_from_str(text, "%H:%M"))
        .ok()
}

/// When a job given `--begin=value` at `now` may start.
pub fn parse_begin(value: &str, now: DateTime<Local>) -> Result<DateTime<Local>, SlurmError> {
    let v = value.trim().to_ascii_lowercase();
    if let Some(rest) = v.strip_prefix("now") {
        if rest.is_empty() {
            return Ok(now);
        }
        let rest = rest
            .strip_prefix('+')
            .ok_or_else(|| invalid(value, "after now is +N[seconds|minutes|hours|days|weeks]"))?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let count: i64 = digits
            .parse()
            .map_err(|_| invalid(value, "after now+ needs a number"))?;
        let unit = &rest[digits.len()..];
        let seconds = match unit {
            "" | "s" | "sec" | "secs" | "second" | "seconds" => 1,
            "m" | "min" | "mins" | "minute" | "minutes" => 60,
            "h" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            "w" | "week" | "weeks" => 7 * 86_400,
            _ => {
                return Err(invalid(
                    value,
                    "units are seconds, minutes, hours, days or weeks",
                ))
            }
        };
        let offset = count
            .checked_mul(seconds)
            .filter(|s| *s <= 366 * 86_400)
            .ok_or_else(|| invalid(value, "is at most a year away"))?;
        return Ok(now + Duration::seconds(offset));
    }
    let midnight = NaiveTime::MIN;
    let word = |h: u32| NaiveTime::from_hms_opt(h, 0, 0).expect("a valid hour");
    match v.as_str() {
        "today" => return local(value, now.date_naive(), midnight).map(|t| t.max(now)),
        "tomorrow" => return local(value, now.date_naive() + Duration::days(1), midnight),
        "midnight" => return next_at(value, now, midnight),
        "noon" => return next_at(value, now, word(12)),
        "fika" => return next_at(value, now, word(15)),
        "teatime" => return next_at(value, now, word(16)),
        _ => {}
    }
    if let Some(time) = time_of_day(&v) {
        return next_at(value, now, time);
    }
    let (date_text, time_text) = match v.split_once('t') {
        Some((d, t)) => (d, Some(t)),
        None => (v.as_str(), None),
    };
    let time = match time_text {
        Some(t) => time_of_day(t).ok_or_else(|| invalid(value, "time is HH:MM[:SS]"))?,
        None => midnight,
    };
    let date = NaiveDate::parse_from_str(date_text, "%Y-%m-%d")
        .or_else(|_| NaiveDate::parse_from_str(date_text, "%m/%d/%y"))
        .or_else(|_| {
            // MM/DD: this year's.
            NaiveDate::parse_from_str(&format!("{date_text}/{}", now.format("%Y")), "%m/%d/%Y")
        })
        .map_err(|_| {
            invalid(
                value,
                "is now[+N units], HH:MM[:SS], YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY], midnight, \
                 noon, fika, teatime, today or tomorrow",
            )
        })?;
    local(value, date, time)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Local> {
        let naive = NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S").unwrap();
        Local.from_local_datetime(&naive).earliest().unwrap()
    }

    #[test]
    fn sbatch_begin_forms() {
        let now = at("2026-12-07 10:30:00");
        let begin = |v: &str| parse_begin(v, now).unwrap();
        assert_eq!(begin("now"), now);
        assert_eq!(begin("now+60"), at("2026-12-07 10:31:00"));
        assert_eq!(begin("now+1hour"), at("2026-12-07 11:30:00"));
        assert_eq!(begin("now+2days"), at("2026-12-09 10:30:00"));
        assert_eq!(begin("16:00"), at("2026-12-07 16:00:00"));
        assert_eq!(begin("09:15:30"), at("2026-12-08 09:15:30"));
        assert_eq!(begin("teatime"), at("2026-12-07 16:00:00"));
        assert_eq!(begin("midnight"), at("2026-12-08 00:00:00"));
        assert_eq!(begin("tomorrow"), at("2026-12-08 00:00:00"));
        assert_eq!(begin("2026-12-24"), at("2026-12-24 00:00:00"));
        assert_eq!(begin("2026-12-24T18:05"), at("2026-12-24 18:05:00"));
        assert_eq!(begin("12/25"), at("2026-12-25 00:00:00"));
        for bad in [
            "later",
            "now-5",
            "now+5fortnights",
            "now+99999999999",
            "25:00",
            "2026-13-01",
        ] {
            assert!(parse_begin(bad, now).is_err(), "{bad}");
        }
    }
}
