//! `squeue -o FORMAT` and `squeue -O FIELDS`: the columns a user picks, in
//! squeue's own letters and names.
//!
//! `-o`: text with `%[.][width]X` fields (`.` right-justifies; a value
//! longer than its width is cut, as squeue cuts it). `-O`: comma-separated
//! names, each `Name[:[.]width]` (default width 20), each column followed
//! by a space.

use chrono::TimeZone as _;

use crate::accounting::{JobRecord, JobState};
use crate::time::format_squeue_time;
use crate::SlurmError;

/// One column squeue can show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `%i`: `123_4` for an array task.
    JobIdShown,
    /// `%A`: the task's own job id.
    JobIdRaw,
    /// `%F`.
    ArrayJobId,
    /// `%K`.
    ArrayTaskId,
    Name,
    User,
    Partition,
    Account,
    StateCompact,
    State,
    TimeUsed,
    TimeLimit,
    Nodes,
    Cpus,
    NodeList,
    Reason,
    /// `%R`: the reason in parentheses while pending, else the node list.
    ReasonList,
    SubmitTime,
    StartTime,
    EndTime,
}

impl Field {
    fn of_letter(c: char) -> Option<Field> {
        use Field::*;
        Some(match c {
            'i' => JobIdShown,
            'A' => JobIdRaw,
            'F' => ArrayJobId,
            'K' => ArrayTaskId,
            'j' => Name,
            'u' => User,
            'P' => Partition,
            'a' => Account,
            't' => StateCompact,
            'T' => State,
            'M' => TimeUsed,
            'l' => TimeLimit,
            'D' => Nodes,
            'C' => Cpus,
            'N' => NodeList,
            'r' => Reason,
            'R' => ReasonList,
            'V' => SubmitTime,
            'S' => StartTime,
            'e' => EndTime,
            _ => return None,
        })
    }

    fn of_name(name: &str) -> Option<Field> {
        use Field::*;
        Some(match name.to_ascii_lowercase().as_str() {
            "jobid" => JobIdShown,
            "jobidraw" => JobIdRaw,
            "arrayjobid" => ArrayJobId,
            "arraytaskid" => ArrayTaskId,
            "name" => Name,
            "username" | "user" => User,
            "partition" => Partition,
            "account" => Account,
            "statecompact" => StateCompact,
            "state" => State,
            "timeused" => TimeUsed,
            "timelimit" => TimeLimit,
            "numnodes" => Nodes,
            "numcpus" => Cpus,
            "nodelist" => NodeList,
            "reason" => Reason,
            "reasonlist" => ReasonList,
            "submittime" => SubmitTime,
            "starttime" => StartTime,
            "endtime" => EndTime,
            _ => return None,
        })
    }

    /// squeue's header for the column.
    fn header(self) -> &'static str {
        use Field::*;
        match self {
            JobIdShown | JobIdRaw => "JOBID",
            ArrayJobId => "ARRAY_JOB_ID",
            ArrayTaskId => "ARRAY_TASK_ID",
            Name => "NAME",
            User => "USER",
            Partition => "PARTITION",
            Account => "ACCOUNT",
            StateCompact => "ST",
            State => "STATE",
            TimeUsed => "TIME",
            TimeLimit => "TIME_LIMIT",
            Nodes => "NODES",
            Cpus => "CPUS",
            NodeList => "NODELIST",
            Reason => "REASON",
            ReasonList => "NODELIST(REASON)",
            SubmitTime => "SUBMIT_TIME",
            StartTime => "START_TIME",
            EndTime => "END_TIME",
        }
    }

    /// The column's text for a row shown as `shown` (the id, folded for
    /// pending array tasks).
    fn value(self, shown: &str, r: &JobRecord) -> String {
        use Field::*;
        let pending = matches!(r.state, JobState::Pending | JobState::Requeued);
        let time = |t: Option<i64>| {
            t.and_then(|t| chrono::Local.timestamp_opt(t, 0).single())
                .map_or("N/A".to_owned(), |t| {
                    t.format("%Y-%m-%dT%H:%M:%S").to_string()
                })
        };
        match self {
            JobIdShown => shown.to_owned(),
            JobIdRaw => r.job_id.to_string(),
            ArrayJobId => r.array_job_id.unwrap_or(r.job_id).to_string(),
            ArrayTaskId => r.task_id.map_or("N/A".to_owned(), |t| t.to_string()),
            Name => r.name.clone(),
            User => r.user.clone(),
            Partition => r.partition.clone(),
            Account => r.account.clone().unwrap_or_else(|| "(null)".into()),
            StateCompact => r.state.compact().to_owned(),
            State => r.state.as_str().to_owned(),
            TimeUsed => format_squeue_time(if pending {
                std::time::Duration::ZERO
            } else {
                r.elapsed
            }),
            TimeLimit => match r.time_limit {
                Some(crate::script::TimeLimit::Limit(d)) => format_squeue_time(d),
                Some(crate::script::TimeLimit::Unlimited) => "UNLIMITED".into(),
                None => "N/A".into(),
            },
            Nodes => "1".into(),
            Cpus => r.alloc_cpus.to_string(),
            NodeList => {
                if pending {
                    String::new()
                } else {
                    r.node.clone().unwrap_or_default()
                }
            }
            Reason => r.reason.clone().unwrap_or_else(|| "None".into()),
            ReasonList => {
                if pending {
                    format!("({})", r.reason.as_deref().unwrap_or("None"))
                } else {
                    r.node.clone().unwrap_or_default()
                }
            }
            SubmitTime => time(r.submit),
            StartTime => time(r.start),
            EndTime => time(r.end),
        }
    }
}

/// A piece of a custom format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Column {
        field: Field,
        width: Option<usize>,
        right: bool,
    },
}

fn bad(spec: &str, reason: String) -> SlurmError {
    SlurmError::InvalidCount {
        value: spec.to_owned(),
        reason,
    }
}

/// `-o FORMAT`.
pub fn parse_format(spec: &str) -> Result<Vec<Piece>, SlurmError> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut chars = spec.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            text.push(c);
            continue;
        }
        if chars.peek() == Some(&'%') {
            chars.next();
            text.push('%');
            continue;
        }
        let right = chars.peek() == Some(&'.');
        if right {
            chars.next();
        }
        // `-`: left-justified, as without it.
        if chars.peek() == Some(&'-') {
            chars.next();
        }
        let mut digits = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            digits.push(*d);
            chars.next();
        }
        let letter = chars
            .next()
            .ok_or_else(|| bad(spec, "-o ends inside a field".into()))?;
        let field = Field::of_letter(letter).ok_or_else(|| {
            bad(
                spec,
                format!("-o: %{letter} is not a field Shoal's squeue knows"),
            )
        })?;
        if !text.is_empty() {
            pieces.push(Piece::Text(std::mem::take(&mut text)));
        }
        pieces.push(Piece::Column {
            field,
            width: digits.parse().ok(),
            right,
        });
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

/// `-O FIELDS`.
pub fn parse_long_format(spec: &str) -> Result<Vec<Piece>, SlurmError> {
    let mut pieces = Vec::new();
    for item in spec.split(',').filter(|i| !i.is_empty()) {
        let (name, size) = match item.split_once(':') {
            Some((n, s)) => (n, Some(s)),
            None => (item, None),
        };
        let field = Field::of_name(name).ok_or_else(|| {
            bad(
                spec,
                format!("-O: {name} is not a field Shoal's squeue knows"),
            )
        })?;
        let (right, width) = match size {
            None | Some("") => (false, 20),
            Some(s) => {
                let right = s.starts_with('.');
                let w = s
                    .trim_start_matches('.')
                    .parse()
                    .map_err(|_| bad(spec, format!("-O: {item}: the size is a number")))?;
                (right, w)
            }
        };
        pieces.push(Piece::Column {
            field,
            width: Some(width),
            right,
        });
        pieces.push(Piece::Text(" ".into()));
    }
    Ok(pieces)
}

fn fit(value: &str, width: Option<usize>, right: bool) -> String {
    let Some(w) = width else {
        return value.to_owned();
    };
    let cut: String = value.chars().take(w).collect();
    if right {
        format!("{cut:>w$}")
    } else {
        format!("{cut:<w$}")
    }
}

/// One line of a custom format; `None` row: the header.
pub fn format_line(pieces: &[Piece], row: Option<(&str, &JobRecord)>) -> String {
    let mut line = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => line.push_str(t),
            Piece::Column {
                field,
                width,
                right,
            } => {
                let value = match row {
                    None => field.header().to_owned(),
                    Some((shown, record)) => field.value(shown, record),
                };
                line.push_str(&fit(&value, *width, *right));
            }
        }
    }
    line.trim_end().to_owned() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_letters_widths_and_text() {
        let pieces = parse_format("%.6i|%-4t %r %%").unwrap();
        assert_eq!(pieces.len(), 6);
        assert_eq!(
            pieces[0],
            Piece::Column {
                field: Field::JobIdShown,
                width: Some(6),
                right: true
            }
        );
        assert!(parse_format("%q").is_err());
        assert!(parse_format("%.5").is_err());
        let long = parse_long_format("JobID:8,State,Reason:.7").unwrap();
        assert_eq!(
            long[0],
            Piece::Column {
                field: Field::JobIdShown,
                width: Some(8),
                right: false
            }
        );
        assert!(parse_long_format("Bogus").is_err());
        assert_eq!(fit("abcdef", Some(3), false), "abc");
        assert_eq!(fit("ab", Some(4), true), "  ab");
    }
}
