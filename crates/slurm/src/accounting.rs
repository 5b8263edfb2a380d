//! sacct and squeue presentation, and job references for scancel.
//!
//! Owns: [`JobRecord`] (what Shoal knows of one job or array task), job
//! states in Slurm's spelling, sacct's `--format` field names and widths
//! (from Slurm's `sacct.c` field table), its fixed-width, `-p` and `-P`
//! output (from Slurm's `print_fields.c`), squeue's default columns
//! (`%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R`) with pending array tasks
//! folded into one `JOBID_[ids]` line, and parsing `123`, `123_4`,
//! `123_[1-3]`.
//! May not: query the store, read clocks or time zones (the caller passes
//! the UTC offset for `Start`/`End`), or decide job states.
//!
//! Differences from Slurm: there are no job steps (`.batch`, `.extern`), so
//! `MaxRSS` and `TotalCPU` are shown on the job's own line; `Cost` (US
//! dollars) is Shoal's field.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::array::{compress_ranges, parse_array};
use crate::memory::format_mem_mib;
use crate::script::TimeLimit;
use crate::time::{format_elapsed, format_squeue_time, format_total_cpu, round_up_to_minute};
use crate::SlurmError;

/// A job, or one task of an array: `job_id` alone, or `job_id_task_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct JobRef {
    pub job_id: u64,
    pub task_id: Option<u32>,
}

impl fmt::Display for JobRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.task_id {
            Some(t) => write!(f, "{}_{t}", self.job_id),
            None => write!(f, "{}", self.job_id),
        }
    }
}

/// Parses `123` or `123_4` (scancel, `--dependency`).
pub fn parse_job_ref(s: &str) -> Result<JobRef, SlurmError> {
    let invalid = || SlurmError::InvalidJobRef {
        value: s.to_string(),
    };
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    let t = s.trim();
    let (job, task) = match t.split_once('_') {
        Some((j, k)) => (j, Some(k)),
        None => (t, None),
    };
    if !digits(job) {
        return Err(invalid());
    }
    let job_id = job.parse().map_err(|_| invalid())?;
    let task_id = match task {
        Some(k) if digits(k) => Some(k.parse().map_err(|_| invalid())?),
        Some(_) => return Err(invalid()),
        None => None,
    };
    Ok(JobRef { job_id, task_id })
}

/// Parses what scancel accepts for one argument: `123`, `123_4`, or a set
/// of tasks `123_[1-3,7]` (expanded, one reference per task).
pub fn parse_job_refs(s: &str) -> Result<Vec<JobRef>, SlurmError> {
    let t = s.trim();
    if let Some((job, tasks)) = t.split_once("_[") {
        let tasks = tasks
            .strip_suffix(']')
            .ok_or_else(|| SlurmError::InvalidJobRef {
                value: s.to_string(),
            })?;
        let job_id = parse_job_ref(job)?.job_id;
        let spec = parse_array(tasks).map_err(|_| SlurmError::InvalidJobRef {
            value: s.to_string(),
        })?;
        if spec.throttle.is_some() {
            return Err(SlurmError::InvalidJobRef {
                value: s.to_string(),
            });
        }
        return Ok(spec
            .task_ids
            .into_iter()
            .map(|t| JobRef {
                job_id,
                task_id: Some(t),
            })
            .collect());
    }
    Ok(vec![parse_job_ref(t)?])
}

/// `Submitted batch job <id>`, as sbatch prints it (with `--parsable`,
/// print the id alone).
pub fn format_submitted(job_id: u64) -> String {
    format!("Submitted batch job {job_id}")
}

/// A job state, in Slurm's spelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum JobState {
    #[default]
    Pending,
    Running,
    Completing,
    Completed,
    Failed,
    Timeout,
    Cancelled,
    NodeFail,
    Requeued,
    OutOfMemory,
}

impl JobState {
    pub const ALL: [JobState; 10] = [
        JobState::Pending,
        JobState::Running,
        JobState::Completing,
        JobState::Completed,
        JobState::Failed,
        JobState::Timeout,
        JobState::Cancelled,
        JobState::NodeFail,
        JobState::Requeued,
        JobState::OutOfMemory,
    ];

    /// sacct's `State`: `PENDING`, `NODE_FAIL`, `OUT_OF_MEMORY`...
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "PENDING",
            JobState::Running => "RUNNING",
            JobState::Completing => "COMPLETING",
            JobState::Completed => "COMPLETED",
            JobState::Failed => "FAILED",
            JobState::Timeout => "TIMEOUT",
            JobState::Cancelled => "CANCELLED",
            JobState::NodeFail => "NODE_FAIL",
            JobState::Requeued => "REQUEUED",
            JobState::OutOfMemory => "OUT_OF_MEMORY",
        }
    }

    /// squeue's `ST` code (squeue(1), JOB STATE CODES).
    pub fn compact(self) -> &'static str {
        match self {
            JobState::Pending => "PD",
            JobState::Running => "R",
            JobState::Completing => "CG",
            JobState::Completed => "CD",
            JobState::Failed => "F",
            JobState::Timeout => "TO",
            JobState::Cancelled => "CA",
            JobState::NodeFail => "NF",
            JobState::Requeued => "RQ",
            JobState::OutOfMemory => "OOM",
        }
    }

    /// Still in the queue: squeue shows it.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            JobState::Pending | JobState::Running | JobState::Completing | JobState::Requeued
        )
    }

    /// Over, for good (requeued jobs are not).
    pub fn is_finished(self) -> bool {
        !self.is_active()
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for JobState {
    type Err = String;

    /// Accepts sacct's spelling or squeue's code, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let up = s.trim().to_ascii_uppercase();
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == up || st.compact() == up)
            .ok_or_else(|| format!("unknown job state {s:?}"))
    }
}

/// What Shoal knows of one job or array task.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    /// This job's (or task's) own id: `JobIDRaw`.
    pub job_id: u64,
    /// The array's master job id, for array tasks.
    pub array_job_id: Option<u64>,
    /// The task's index, for array tasks.
    pub task_id: Option<u32>,
    pub name: String,
    pub user: String,
    pub partition: String,
    pub account: Option<String>,
    pub state: JobState,
    /// The script's exit status (`ExitCode`'s first half).
    pub exit_code: i32,
    /// The signal that ended it, or 0 (`ExitCode`'s second half).
    pub signal: i32,
    /// Wall time run so far or in all.
    pub elapsed: Duration,
    /// vCPUs of its sandbox (`AllocCPUS`); `CPUTime` is `Elapsed` times this.
    pub alloc_cpus: u32,
    /// Memory asked for (`ReqMem`).
    pub req_mem_mib: Option<u64>,
    /// Peak resident memory (`MaxRSS`).
    pub max_rss_bytes: Option<u64>,
    /// CPU time actually used, user plus system (`TotalCPU`).
    pub total_cpu: Option<Duration>,
    /// What it cost, in US dollars (`Cost`).
    pub cost_usd: Option<f64>,
    /// Unix times (seconds) of submission, start and end.
    pub submit: Option<i64>,
    pub start: Option<i64>,
    pub end: Option<i64>,
    /// `Timelimit`.
    pub time_limit: Option<TimeLimit>,
    /// The sandbox that ran it (`NodeList`).
    pub node: Option<String>,
    /// Why it is pending (`Resources`, `Dependency`, `JobArrayTaskLimit`...).
    pub reason: Option<String>,
    /// How many times it was requeued (`Restarts`).
    pub restarts: u32,
}

impl JobRecord {
    /// sacct's `JobID`: `array_task` for array tasks, else the job id.
    pub fn display_id(&self) -> String {
        match (self.array_job_id, self.task_id) {
            (Some(a), Some(t)) => format!("{a}_{t}"),
            _ => self.job_id.to_string(),
        }
    }

    /// sacct's `CPUTime`: elapsed time times allocated CPUs.
    pub fn cpu_time(&self) -> Duration {
        self.elapsed.saturating_mul(self.alloc_cpus)
    }
}

/// How a field's value is padded and cut (after Slurm's print routines).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `print_fields_str`: cut to the width with a `+` as the last character.
    Str,
    /// Numbers and durations: never cut.
    Num,
    /// `print_fields_date`: cut to the width, no `+`.
    Date,
}

/// The sacct fields Shoal can show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SacctField {
    Account,
    AllocCPUS,
    Cost,
    CPUTime,
    CPUTimeRAW,
    Elapsed,
    ElapsedRaw,
    End,
    ExitCode,
    JobID,
    JobIDRaw,
    JobName,
    MaxRSS,
    NCPUS,
    NNodes,
    NodeList,
    Partition,
    Reason,
    ReqMem,
    Restarts,
    Start,
    State,
    Submit,
    Timelimit,
    TotalCPU,
    User,
}

impl SacctField {
    pub const ALL: [SacctField; 26] = [
        SacctField::Account,
        SacctField::AllocCPUS,
        SacctField::Cost,
        SacctField::CPUTime,
        SacctField::CPUTimeRAW,
        SacctField::Elapsed,
        SacctField::ElapsedRaw,
        SacctField::End,
        SacctField::ExitCode,
        SacctField::JobID,
        SacctField::JobIDRaw,
        SacctField::JobName,
        SacctField::MaxRSS,
        SacctField::NCPUS,
        SacctField::NNodes,
        SacctField::NodeList,
        SacctField::Partition,
        SacctField::Reason,
        SacctField::ReqMem,
        SacctField::Restarts,
        SacctField::Start,
        SacctField::State,
        SacctField::Submit,
        SacctField::Timelimit,
        SacctField::TotalCPU,
        SacctField::User,
    ];

    /// The name in Slurm's spelling, as the header shows it.
    pub fn name(self) -> &'static str {
        self.spec().0
    }

    /// Slurm's default width: negative is left-aligned, positive right.
    pub fn default_width(self) -> i32 {
        self.spec().1
    }

    fn kind(self) -> Kind {
        self.spec().2
    }

    fn spec(self) -> (&'static str, i32, Kind) {
        use Kind::*;
        use SacctField as F;
        match self {
            F::Account => ("Account", 10, Str),
            F::AllocCPUS => ("AllocCPUS", 10, Num),
            F::Cost => ("Cost", 10, Num),
            F::CPUTime => ("CPUTime", 10, Num),
            F::CPUTimeRAW => ("CPUTimeRAW", 10, Num),
            F::Elapsed => ("Elapsed", 10, Num),
            F::ElapsedRaw => ("ElapsedRaw", 10, Num),
            F::End => ("End", 19, Date),
            F::ExitCode => ("ExitCode", 8, Str),
            F::JobID => ("JobID", -12, Str),
            F::JobIDRaw => ("JobIDRaw", -12, Str),
            F::JobName => ("JobName", 10, Str),
            F::MaxRSS => ("MaxRSS", 10, Str),
            F::NCPUS => ("NCPUS", 10, Num),
            F::NNodes => ("NNodes", 8, Num),
            F::NodeList => ("NodeList", 15, Str),
            F::Partition => ("Partition", 10, Str),
            F::Reason => ("Reason", 22, Str),
            F::ReqMem => ("ReqMem", 10, Str),
            F::Restarts => ("Restarts", 8, Num),
            F::Start => ("Start", 19, Date),
            F::State => ("State", 10, Str),
            F::Submit => ("Submit", 19, Date),
            F::Timelimit => ("Timelimit", 10, Str),
            F::TotalCPU => ("TotalCPU", 10, Str),
            F::User => ("User", 9, Str),
        }
    }

    /// Looks a field up by name, in any case (`jobid`, `MAXRSS`).
    pub fn from_name(name: &str) -> Option<SacctField> {
        SacctField::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// One `--format` element: a field and its width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldSpec {
    pub field: SacctField,
    /// Negative: left-aligned; positive: right-aligned.
    pub width: i32,
}

impl From<SacctField> for FieldSpec {
    fn from(field: SacctField) -> FieldSpec {
        FieldSpec {
            field,
            width: field.default_width(),
        }
    }
}

/// sacct's default fields: `JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode`.
pub fn default_sacct_fields() -> Vec<FieldSpec> {
    use SacctField as F;
    [
        F::JobID,
        F::JobName,
        F::Partition,
        F::Account,
        F::AllocCPUS,
        F::State,
        F::ExitCode,
    ]
    .into_iter()
    .map(FieldSpec::from)
    .collect()
}

/// `sacct -l`: the long listing, as far as Shoal measures the fields
/// (sacct's own adds step, VM-size, page and frequency fields it has none of).
pub fn long_sacct_fields() -> Vec<FieldSpec> {
    use SacctField as F;
    [
        F::JobID,
        F::JobIDRaw,
        F::JobName,
        F::Partition,
        F::MaxRSS,
        F::AllocCPUS,
        F::ReqMem,
        F::Elapsed,
        F::CPUTime,
        F::TotalCPU,
        F::State,
        F::ExitCode,
        F::Submit,
        F::Start,
        F::End,
        F::NodeList,
        F::Timelimit,
        F::Cost,
    ]
    .into_iter()
    .map(FieldSpec::from)
    .collect()
}

/// Whether `record` ran (or waited) within `[start, end]` (unix seconds;
/// `now` for what has not ended): sacct's `-S`/`-E` window.
pub fn within_window(record: &JobRecord, start: Option<i64>, end: Option<i64>, now: i64) -> bool {
    let began = record.start.or(record.submit).unwrap_or(now);
    let ended = record.end.unwrap_or(now);
    start.is_none_or(|s| ended >= s) && end.is_none_or(|e| began <= e)
}

/// Parses a `--format` value such as `JobID,JobName%20,State,MaxRSS%-12`:
/// names in any case, an optional `%N` width (`%-N` left-aligns), empty
/// elements skipped. An unknown name is sacct's error
/// `Invalid field requested: "..."`.
pub fn parse_format(format: &str) -> Result<Vec<FieldSpec>, SlurmError> {
    let mut out = Vec::new();
    for item in format.split(',') {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let (name, width) = match item.split_once('%') {
            Some((n, w)) => {
                let w: i32 = w
                    .trim()
                    .parse()
                    .map_err(|_| SlurmError::InvalidWidth(item.to_string()))?;
                (n, (w != 0).then_some(w))
            }
            None => (item, None),
        };
        let field = SacctField::from_name(name)
            .ok_or_else(|| SlurmError::UnknownField(name.to_string()))?;
        out.push(FieldSpec {
            field,
            width: width.unwrap_or(field.default_width()),
        });
    }
    Ok(out)
}

/// sacct's output styles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SacctStyle {
    /// Fixed-width columns, a header and a line of dashes.
    #[default]
    Table,
    /// `-p`: `|` after every field, the last one included.
    Parsable,
    /// `-P`: `|` between fields, none at the end.
    Parsable2,
}

/// How to print sacct output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SacctOptions {
    pub style: SacctStyle,
    /// `-n`: no header.
    pub noheader: bool,
    /// Offset of the local time zone from UTC, for `Start`, `End`, `Submit`.
    pub utc_offset_seconds: i32,
}

/// sacct output with `-P` (`parsable`) or as a table; times in UTC. See
/// [`format_sacct_with`].
pub fn format_sacct(records: &[JobRecord], fields: &[FieldSpec], parsable: bool) -> String {
    let style = if parsable {
        SacctStyle::Parsable2
    } else {
        SacctStyle::Table
    };
    format_sacct_with(
        records,
        fields,
        &SacctOptions {
            style,
            ..Default::default()
        },
    )
}

/// sacct output, one line per record, as Slurm's `print_fields` writes it:
/// in a table every cell is padded to its width and followed by a space
/// (so lines end in a space), strings too long end in `+`; the header is
/// followed by a line of dashes. With `-p`/`-P` values are not padded and
/// the header has the same shape as the rows.
pub fn format_sacct_with(
    records: &[JobRecord],
    fields: &[FieldSpec],
    opts: &SacctOptions,
) -> String {
    let mut out = String::new();
    let parsable = opts.style != SacctStyle::Table;
    let join = |cells: Vec<String>, out: &mut String| {
        match opts.style {
            SacctStyle::Table => {
                for c in cells {
                    out.push_str(&c);
                    out.push(' ');
                }
            }
            SacctStyle::Parsable => {
                for c in cells {
                    out.push_str(&c);
                    out.push('|');
                }
            }
            SacctStyle::Parsable2 => out.push_str(&cells.join("|")),
        }
        out.push('\n');
    };
    if !opts.noheader {
        let header = fields
            .iter()
            .map(|f| {
                let name = f.field.name();
                if parsable {
                    name.to_string()
                } else {
                    pad(&cut(name, f.width.unsigned_abs() as usize, false), f.width)
                }
            })
            .collect();
        join(header, &mut out);
        if !parsable {
            let dashes = fields
                .iter()
                .map(|f| "-".repeat(f.width.unsigned_abs() as usize))
                .collect();
            join(dashes, &mut out);
        }
    }
    for r in records {
        let cells = fields
            .iter()
            .map(|f| {
                let value = field_value(r, f.field, opts.utc_offset_seconds);
                if parsable {
                    return value.unwrap_or_default();
                }
                let w = f.width.unsigned_abs() as usize;
                let shown = match (value, f.field.kind()) {
                    (None, _) => String::new(),
                    (Some(v), Kind::Str) => cut(&v, w, true),
                    (Some(v), Kind::Date) => cut(&v, w, false),
                    (Some(v), Kind::Num) => v,
                };
                pad(&shown, f.width)
            })
            .collect();
        join(cells, &mut out);
    }
    out
}

fn cut(s: &str, width: usize, plus: bool) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    if plus && width > 0 {
        let mut t: String = s.chars().take(width - 1).collect();
        t.push('+');
        t
    } else {
        s.chars().take(width).collect()
    }
}

fn pad(s: &str, width: i32) -> String {
    let w = width.unsigned_abs() as usize;
    if width < 0 {
        format!("{s:<w$}")
    } else {
        format!("{s:>w$}")
    }
}

fn field_value(r: &JobRecord, field: SacctField, offset: i32) -> Option<String> {
    use SacctField as F;
    Some(match field {
        F::Account => r.account.clone()?,
        F::AllocCPUS | F::NCPUS => r.alloc_cpus.to_string(),
        F::Cost => format!("{:.6}", r.cost_usd?),
        F::CPUTime => format_elapsed(r.cpu_time()),
        F::CPUTimeRAW => r.cpu_time().as_secs().to_string(),
        F::Elapsed => format_elapsed(r.elapsed),
        F::ElapsedRaw => r.elapsed.as_secs().to_string(),
        F::End => format_date(r.end, offset),
        F::ExitCode => format!("{}:{}", r.exit_code, r.signal),
        F::JobID => r.display_id(),
        F::JobIDRaw => r.job_id.to_string(),
        F::JobName => r.name.clone(),
        F::MaxRSS => format_rss(r.max_rss_bytes?),
        F::NNodes => "1".to_string(),
        F::NodeList => r
            .node
            .clone()
            .unwrap_or_else(|| "None assigned".to_string()),
        F::Partition => r.partition.clone(),
        F::Reason => r.reason.clone().unwrap_or_else(|| "None".to_string()),
        F::ReqMem => format_mem_mib(r.req_mem_mib?),
        F::Restarts => r.restarts.to_string(),
        F::Start => format_date(r.start, offset),
        F::State => r.state.as_str().to_string(),
        F::Submit => format_date(r.submit, offset),
        F::Timelimit => match r.time_limit? {
            TimeLimit::Unlimited => "UNLIMITED".to_string(),
            TimeLimit::Limit(d) => format_elapsed(round_up_to_minute(d)),
        },
        F::TotalCPU => format_total_cpu(r.total_cpu?),
        F::User => r.user.clone(),
    })
}

/// `MaxRSS` as sacct shows it (Slurm's `convert_num_unit` with
/// `CONVERT_NUM_UNIT_EXACT`): divided by 1024 while that stays exact to
/// half a unit, with `K`, `M`, `G`... (`126418944` gives `123456K`).
pub fn format_rss(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_string();
    }
    let units = ["", "K", "M", "G", "T", "P"];
    let mut num = bytes as f64;
    let mut unit = 0;
    while num >= 1024.0 && (num as u64).is_multiple_of(512) {
        num /= 1024.0;
        unit += 1;
    }
    let suffix = units.get(unit).copied().unwrap_or("?");
    if num.fract() == 0.0 {
        format!("{}{suffix}", num as u64)
    } else {
        format!("{num:.2}{suffix}")
    }
}

/// Slurm's default time format, `YYYY-MM-DDTHH:MM:SS` in local time;
/// `Unknown` when not (yet) known.
fn format_date(unix: Option<i64>, offset: i32) -> String {
    let Some(t) = unix else {
        return "Unknown".to_string();
    };
    let t = t + i64::from(offset);
    let days = t.div_euclid(86_400);
    let secs = t.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        secs / 3_600,
        (secs / 60) % 60,
        secs % 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's
/// algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// squeue's default output: `JOBID PARTITION NAME USER ST TIME NODES
/// NODELIST(REASON)`, widths 18, 9, 8, 8, 2, 10, 6, right-aligned and cut,
/// for the records still in the queue ([`JobState::is_active`]); finished
/// ones are left out, as squeue leaves them out. Pending tasks of one array
/// (same partition, name, user and reason) share a line, `1080_[5-1024]`,
/// placed where the first of them was.
/// `scontrol show job`: one record per task, `Key=Value` lines as
/// scontrol prints them (the fields Shoal has), then `extra` (the job's
/// command, directories and output files) on the last lines.
pub fn format_scontrol_job(records: &[JobRecord], extra: &[(&str, String)], offset: i32) -> String {
    use SacctField as F;
    let value = |r: &JobRecord, f: SacctField, missing: &str| {
        field_value(r, f, offset).unwrap_or_else(|| missing.to_owned())
    };
    let mut out = String::new();
    for r in records {
        let mut head = format!("JobId={}", r.job_id);
        if let (Some(array), Some(task)) = (r.array_job_id, r.task_id) {
            head.push_str(&format!(" ArrayJobId={array} ArrayTaskId={task}"));
        }
        head.push_str(&format!(" JobName={}", r.name));
        let lines = [
            head,
            format!(
                "UserId={} Account={}",
                r.user,
                r.account.as_deref().unwrap_or("(null)")
            ),
            format!(
                "JobState={} Reason={} ExitCode={}:{}",
                r.state.as_str(),
                r.reason.as_deref().unwrap_or("None"),
                r.exit_code,
                r.signal
            ),
            format!(
                "RunTime={} TimeLimit={} Restarts={}",
                format_elapsed(r.elapsed),
                value(r, F::Timelimit, "UNLIMITED"),
                r.restarts
            ),
            format!(
                "SubmitTime={} StartTime={} EndTime={}",
                format_date(r.submit, offset),
                format_date(r.start, offset),
                format_date(r.end, offset)
            ),
            format!(
                "Partition={} NodeList={} NumNodes=1 NumCPUs={} NumTasks=1 CPUs/Task={}",
                r.partition,
                r.node.as_deref().unwrap_or("(null)"),
                r.alloc_cpus,
                r.alloc_cpus
            ),
            format!("MinMemoryNode={}", value(r, F::ReqMem, "0")),
        ];
        for (i, line) in lines.iter().enumerate() {
            out.push_str(if i == 0 { "" } else { "   " });
            out.push_str(line);
            out.push('\n');
        }
        for (key, v) in extra {
            out.push_str(&format!("   {key}={v}\n"));
        }
        out.push('\n');
    }
    out
}

/// The states a `squeue -t`/`sacct -s` list names: comma-separated long
/// (`RUNNING`) or compact (`R`) names in any case, or `all`.
pub fn parse_states(list: &str) -> Result<Vec<JobState>, SlurmError> {
    let mut states = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        if item.eq_ignore_ascii_case("all") {
            return Ok(JobState::ALL.to_vec());
        }
        let state = JobState::ALL
            .into_iter()
            .find(|s| {
                item.eq_ignore_ascii_case(s.as_str()) || item.eq_ignore_ascii_case(s.compact())
            })
            .ok_or_else(|| SlurmError::InvalidState {
                value: item.to_owned(),
            })?;
        states.push(state);
    }
    Ok(states)
}

/// Whether `record` is one `refs` names (`123` is a job and all its tasks,
/// `123_4` one task; a task's own id names it too). No refs: all.
pub fn matches_job_refs(record: &JobRecord, refs: &[JobRef]) -> bool {
    refs.is_empty()
        || refs.iter().any(|r| match r.task_id {
            None => r.job_id == record.job_id || Some(r.job_id) == record.array_job_id,
            Some(task) => Some(r.job_id) == record.array_job_id && Some(task) == record.task_id,
        })
}

pub fn format_squeue(records: &[JobRecord]) -> String {
    format_squeue_with(records, true)
}

/// `squeue -r`: every array task on its own line, pending ones included.
pub fn format_squeue_unfolded(records: &[JobRecord]) -> String {
    format_squeue_with(records, false)
}

/// `squeue -o`/`-O`: the columns chosen, a header first.
pub fn format_squeue_custom(
    records: &[JobRecord],
    pieces: &[crate::squeue_format::Piece],
    fold_pending_tasks: bool,
) -> String {
    let mut out = crate::squeue_format::format_line(pieces, None);
    for (shown, r) in squeue_rows(records, fold_pending_tasks) {
        out.push_str(&crate::squeue_format::format_line(
            pieces,
            Some((&shown, r)),
        ));
    }
    out
}

/// The lines squeue shows: queued jobs, each pending array's tasks folded
/// into one `ID_[a-b]` line when `fold_pending_tasks`; the shown id with a
/// record standing for the line.
fn squeue_rows(records: &[JobRecord], fold_pending_tasks: bool) -> Vec<(String, &JobRecord)> {
    let active: Vec<&JobRecord> = records.iter().filter(|r| r.state.is_active()).collect();
    let mut done = vec![false; active.len()];
    let mut rows = Vec::new();
    for i in 0..active.len() {
        if done[i] {
            continue;
        }
        let r = active[i];
        done[i] = true;
        let mut id = r.display_id();
        if let (true, JobState::Pending, Some(array), Some(task)) =
            (fold_pending_tasks, r.state, r.array_job_id, r.task_id)
        {
            let mut tasks = vec![task];
            for j in i + 1..active.len() {
                let o = active[j];
                if !done[j]
                    && o.state == JobState::Pending
                    && o.array_job_id == Some(array)
                    && o.task_id.is_some()
                    && o.partition == r.partition
                    && o.name == r.name
                    && o.user == r.user
                    && o.reason == r.reason
                {
                    tasks.extend(o.task_id);
                    done[j] = true;
                }
            }
            if tasks.len() > 1 {
                tasks.sort_unstable();
                tasks.dedup();
                id = format!("{array}_[{}]", compress_ranges(&tasks));
            }
        }
        rows.push((id, r));
    }
    rows
}

fn format_squeue_with(records: &[JobRecord], fold_pending_tasks: bool) -> String {
    let mut out = String::new();
    push_squeue_line(
        &mut out,
        [
            "JOBID",
            "PARTITION",
            "NAME",
            "USER",
            "ST",
            "TIME",
            "NODES",
            "NODELIST(REASON)",
        ],
    );
    for (id, r) in squeue_rows(records, fold_pending_tasks) {
        let time = match r.state {
            JobState::Pending | JobState::Requeued => format_squeue_time(Duration::ZERO),
            _ => format_squeue_time(r.elapsed),
        };
        let where_ = match r.state {
            JobState::Pending | JobState::Requeued => {
                format!("({})", r.reason.as_deref().unwrap_or("None"))
            }
            _ => r.node.clone().unwrap_or_default(),
        };
        push_squeue_line(
            &mut out,
            [
                &id,
                &r.partition,
                &r.name,
                &r.user,
                r.state.compact(),
                &time,
                "1",
                &where_,
            ],
        );
    }
    out
}

fn push_squeue_line(out: &mut String, cols: [&str; 8]) {
    let [id, part, name, user, st, time, nodes, reason] = cols;
    out.push_str(&format!(
        "{id:>18.18} {part:>9.9} {name:>8.8} {user:>8.8} {st:>2.2} {time:>10.10} {nodes:>6.6} {reason}\n"
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: u64, task: u32, state: JobState) -> JobRecord {
        JobRecord {
            job_id: id,
            array_job_id: Some(1000),
            task_id: Some(task),
            name: "sweep".into(),
            user: "ada".into(),
            partition: "short".into(),
            state,
            alloc_cpus: 2,
            ..Default::default()
        }
    }

    #[test]
    fn job_refs() {
        assert_eq!(
            parse_job_ref("123").unwrap(),
            JobRef {
                job_id: 123,
                task_id: None
            }
        );
        assert_eq!(
            parse_job_ref("123_4").unwrap(),
            JobRef {
                job_id: 123,
                task_id: Some(4)
            }
        );
        assert_eq!(parse_job_ref(" 7_0 ").unwrap().to_string(), "7_0");
        for bad in [
            "",
            "_4",
            "123_",
            "12a",
            "123_x",
            "-1",
            "123_4_5",
            "1.5",
            "123_[1-2]",
        ] {
            assert!(parse_job_ref(bad).is_err(), "{bad:?}");
        }
        let refs = parse_job_refs("20_[1-3,5]").unwrap();
        assert_eq!(
            refs.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
            vec!["20_1", "20_2", "20_3", "20_5"]
        );
        assert_eq!(
            parse_job_refs("20").unwrap(),
            vec![JobRef {
                job_id: 20,
                task_id: None
            }]
        );
        assert!(parse_job_refs("20_[1-3").is_err());
        assert!(parse_job_refs("20_[3-1]").is_err());
        assert!(parse_job_refs("20_[1-3%2]").is_err());
    }

    #[test]
    fn states() {
        for s in JobState::ALL {
            assert_eq!(s.as_str().parse::<JobState>().unwrap(), s);
            assert_eq!(s.compact().parse::<JobState>().unwrap(), s);
            assert_eq!(s.to_string(), s.as_str());
        }
        assert_eq!("node_fail".parse::<JobState>().unwrap(), JobState::NodeFail);
        assert!("DONE".parse::<JobState>().is_err());
        assert_eq!(JobState::OutOfMemory.as_str(), "OUT_OF_MEMORY");
        assert!(JobState::Pending.is_active() && JobState::Requeued.is_active());
        assert!(JobState::Timeout.is_finished());
    }

    #[test]
    fn serde_uses_slurm_spelling() {
        // serde_json is not a dependency; check through the derive's names.
        let names: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
        assert!(names.contains(&"NODE_FAIL"));
    }

    #[test]
    fn format_fields() {
        let f = parse_format("JobID,JobName%20,State").unwrap();
        assert_eq!(f.len(), 3);
        assert_eq!(
            f[0],
            FieldSpec {
                field: SacctField::JobID,
                width: -12
            }
        );
        assert_eq!(
            f[1],
            FieldSpec {
                field: SacctField::JobName,
                width: 20
            }
        );
        assert_eq!(f[2].width, 10);
        let f = parse_format("jobid, maxrss%-15 ,,ELAPSED,cost").unwrap();
        assert_eq!(
            f.iter().map(|s| s.field).collect::<Vec<_>>(),
            vec![
                SacctField::JobID,
                SacctField::MaxRSS,
                SacctField::Elapsed,
                SacctField::Cost
            ]
        );
        assert_eq!(f[1].width, -15);
        assert_eq!(
            parse_format("State%0").unwrap()[0].width,
            10,
            "%0 keeps the default"
        );
        let e = parse_format("JobID,Frob").unwrap_err();
        assert_eq!(e.to_string(), "Invalid field requested: \"Frob\"");
        assert!(matches!(
            parse_format("JobID%x"),
            Err(SlurmError::InvalidWidth(_))
        ));
        assert_eq!(
            default_sacct_fields()
                .iter()
                .map(|f| f.field.name())
                .collect::<Vec<_>>(),
            vec![
                "JobID",
                "JobName",
                "Partition",
                "Account",
                "AllocCPUS",
                "State",
                "ExitCode"
            ]
        );
    }

    fn finished() -> Vec<JobRecord> {
        vec![
            JobRecord {
                job_id: 1000,
                task_id: Some(0),
                state: JobState::Completed,
                elapsed: Duration::from_secs(83),
                max_rss_bytes: Some(126_418_944),
                total_cpu: Some(Duration::from_millis(150_250)),
                cost_usd: Some(0.001_234),
                start: Some(1_700_000_000),
                end: Some(1_700_000_083),
                node: Some("sb-1".into()),
                ..task(1000, 0, JobState::Completed)
            },
            JobRecord {
                exit_code: 0,
                signal: 9,
                elapsed: Duration::from_secs(600),
                ..task(1001, 1, JobState::Timeout)
            },
        ]
    }

    #[test]
    fn parsable2_like_sacct_p() {
        let fields =
            parse_format("JobID,JobName,State,ExitCode,Elapsed,MaxRSS,CPUTime,Cost").unwrap();
        let out = format_sacct(&finished(), &fields, true);
        assert_eq!(
            out,
            "JobID|JobName|State|ExitCode|Elapsed|MaxRSS|CPUTime|Cost\n\
             1000_0|sweep|COMPLETED|0:0|00:01:23|123456K|00:02:46|0.001234\n\
             1000_1|sweep|TIMEOUT|0:9|00:10:00||00:20:00|\n"
        );
    }

    #[test]
    fn parsable_with_trailing_delimiter() {
        let fields = parse_format("JobID,State").unwrap();
        let out = format_sacct_with(
            &finished()[..1],
            &fields,
            &SacctOptions {
                style: SacctStyle::Parsable,
                ..Default::default()
            },
        );
        assert_eq!(out, "JobID|State|\n1000_0|COMPLETED|\n");
        let out = format_sacct_with(
            &finished()[..1],
            &fields,
            &SacctOptions {
                style: SacctStyle::Parsable2,
                noheader: true,
                ..Default::default()
            },
        );
        assert_eq!(out, "1000_0|COMPLETED\n");
    }

    #[test]
    fn table_like_sacct() {
        let out = format_sacct(&finished(), &default_sacct_fields(), false);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            "JobID           JobName  Partition    Account  AllocCPUS      State ExitCode "
        );
        assert_eq!(
            lines[1],
            "------------ ---------- ---------- ---------- ---------- ---------- -------- "
        );
        assert_eq!(
            lines[2],
            "1000_0            sweep      short                     2  COMPLETED      0:0 "
        );
        assert_eq!(
            lines[3],
            "1000_1            sweep      short                     2    TIMEOUT      0:9 "
        );
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn table_cuts_long_strings_with_plus() {
        let r = JobRecord {
            name: "a-very-long-job-name".into(),
            ..task(1, 1, JobState::Running)
        };
        let f = parse_format("JobName,JobName%25,JobName%-5").unwrap();
        let out = format_sacct(&[r], &f, false);
        let row = out.lines().nth(2).unwrap();
        assert_eq!(row, "a-very-lo+      a-very-long-job-name a-ve+ ");
        // The header is cut without a '+'.
        let out = format_sacct(&[], &parse_format("AllocCPUS%4").unwrap(), false);
        assert_eq!(out, "Allo \n---- \n");
    }

    #[test]
    fn dates_and_other_fields() {
        let r = &finished()[0];
        let f = parse_format(
            "Start,End,Submit,NodeList,JobIDRaw,TotalCPU,ElapsedRaw,CPUTimeRAW,NNodes,Reason",
        )
        .unwrap();
        let out = format_sacct(std::slice::from_ref(r), &f, true);
        assert_eq!(
            out.lines().nth(1).unwrap(),
            "2023-11-14T22:13:20|2023-11-14T22:14:43|Unknown|sb-1|1000|02:30.250|83|166|1|None"
        );
        let out = format_sacct_with(
            std::slice::from_ref(r),
            &parse_format("Start").unwrap(),
            &SacctOptions {
                style: SacctStyle::Parsable2,
                noheader: true,
                utc_offset_seconds: 3_600,
            },
        );
        assert_eq!(out, "2023-11-14T23:13:20\n");
        let pending = task(2000, 3, JobState::Pending);
        let out = format_sacct(
            &[pending],
            &parse_format("NodeList,End,Timelimit").unwrap(),
            true,
        );
        assert_eq!(out.lines().nth(1).unwrap(), "None assigned|Unknown|");
    }

    #[test]
    fn timelimit_reqmem_account_restarts() {
        let r = JobRecord {
            time_limit: Some(TimeLimit::Limit(Duration::from_secs(90))),
            req_mem_mib: Some(4096),
            account: Some("lab".into()),
            restarts: 2,
            ..task(1, 1, JobState::Running)
        };
        let out = format_sacct(
            &[r],
            &parse_format("Timelimit,ReqMem,Account,Restarts").unwrap(),
            true,
        );
        assert_eq!(out.lines().nth(1).unwrap(), "00:02:00|4G|lab|2");
        let r = JobRecord {
            time_limit: Some(TimeLimit::Unlimited),
            ..task(1, 1, JobState::Running)
        };
        let out = format_sacct(&[r], &parse_format("Timelimit").unwrap(), true);
        assert_eq!(out.lines().nth(1).unwrap(), "UNLIMITED");
    }

    #[test]
    fn single_job_id() {
        let r = JobRecord {
            job_id: 55,
            ..Default::default()
        };
        assert_eq!(r.display_id(), "55");
    }

    #[test]
    fn rss_like_convert_num_unit_exact() {
        assert_eq!(format_rss(126_418_944), "123456K");
        assert_eq!(format_rss(2 * 1024 * 1024 * 1024), "2G");
        assert_eq!(
            format_rss(1_610_612_736),
            "1.50G",
            "half units are still exact"
        );
        assert_eq!(format_rss(4096), "4K");
        assert_eq!(format_rss(1000), "1000");
        assert_eq!(format_rss(1536), "1.50K");
        assert_eq!(format_rss(0), "0");
        assert_eq!(format_rss(3 * 1024 * 1024), "3M");
    }

    #[test]
    fn civil_dates() {
        assert_eq!(format_date(Some(0), 0), "1970-01-01T00:00:00");
        assert_eq!(format_date(Some(951_782_400), 0), "2000-02-29T00:00:00");
        assert_eq!(format_date(Some(-1), 0), "1969-12-31T23:59:59");
        assert_eq!(format_date(Some(1_709_251_199), 0), "2024-02-29T23:59:59");
        assert_eq!(format_date(None, 0), "Unknown");
    }

    #[test]
    fn squeue_default_columns() {
        let mut recs = vec![
            JobRecord {
                elapsed: Duration::from_secs(17),
                node: Some("sb-3f2a".into()),
                ..task(1000, 0, JobState::Running)
            },
            JobRecord {
                reason: Some("JobArrayTaskLimit".into()),
                ..task(1002, 2, JobState::Pending)
            },
            JobRecord {
                reason: Some("JobArrayTaskLimit".into()),
                ..task(1003, 3, JobState::Pending)
            },
            task(1001, 1, JobState::Completed),
            JobRecord {
                reason: Some("JobArrayTaskLimit".into()),
                ..task(1004, 4, JobState::Pending)
            },
            JobRecord {
                reason: Some("JobArrayTaskLimit".into()),
                ..task(1009, 9, JobState::Pending)
            },
        ];
        recs.push(JobRecord {
            job_id: 2000,
            name: "single".into(),
            user: "bob".into(),
            partition: "long".into(),
            state: JobState::Pending,
            reason: Some("Dependency".into()),
            ..Default::default()
        });
        let out = format_squeue(&recs);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[0],
            "             JOBID PARTITION     NAME     USER ST       TIME  NODES NODELIST(REASON)"
        );
        assert_eq!(
            lines[1],
            "            1000_0     short    sweep      ada  R       0:17      1 sb-3f2a"
        );
        assert_eq!(lines[2], "      1000_[2-4,9]     short    sweep      ada PD       0:00      1 (JobArrayTaskLimit)");
        assert_eq!(
            lines[3],
            "              2000      long   single      bob PD       0:00      1 (Dependency)"
        );
        assert_eq!(lines.len(), 4, "the completed task is not in the queue");

        // -r: one line per pending task; -j 1000_3 and 2000; -t PD.
        let unfolded = format_squeue_unfolded(&recs);
        assert_eq!(unfolded.lines().count(), 7, "{unfolded}");
        let refs = vec![
            parse_job_ref("1000_3").unwrap(),
            parse_job_ref("2000").unwrap(),
        ];
        let named: Vec<u64> = recs
            .iter()
            .filter(|r| matches_job_refs(r, &refs))
            .map(|r| r.job_id)
            .collect();
        assert_eq!(named, [1003, 2000]);
        let whole = crate::parse_job_refs("1000").unwrap();
        assert_eq!(
            recs.iter().filter(|r| matches_job_refs(r, &whole)).count(),
            6
        );
        let pending = parse_states("pd").unwrap();
        assert_eq!(pending, [JobState::Pending]);
        assert_eq!(
            parse_states("RUNNING,cd").unwrap(),
            [JobState::Running, JobState::Completed]
        );
        assert_eq!(parse_states("all").unwrap().len(), JobState::ALL.len());
        assert!(parse_states("SLEEPING")
            .unwrap_err()
            .to_string()
            .contains("PENDING"));
    }

    #[test]
    fn squeue_cuts_and_single_pending_task() {
        let recs = vec![JobRecord {
            name: "a-long-name".into(),
            user: "averylongusername".into(),
            ..task(1005, 5, JobState::Pending)
        }];
        let out = format_squeue(&recs);
        assert_eq!(
            out.lines().nth(1).unwrap(),
            "            1000_5     short a-long-n averylon PD       0:00      1 (None)"
        );
    }

    #[test]
    fn submitted_line() {
        assert_eq!(format_submitted(36), "Submitted batch job 36");
    }
}
