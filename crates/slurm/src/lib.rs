//! The Slurm bridge's pure logic: what `shoal sbatch`, `shoal squeue`,
//! `shoal sacct` and `shoal scancel` need to understand and to print, with
//! no I/O, no HTTP and no VMs.
//!
//! Owns: reading `#SBATCH` scripts ([`script`]), `--array` specs
//! ([`array`](mod@array)), Slurm's time and memory formats ([`time`], [`memory`]),
//! output file name patterns ([`pattern`]), the environment of one task
//! ([`env`](mod@env)), and sacct/squeue presentation plus job references for scancel
//! ([`accounting`]). Behaviour follows Slurm's own manuals and sources
//! (sbatch(1), sacct(1), `print_fields.c`, `parse_time.c`,
//! `str_to_mbytes`, `expand_stdio_fields`); where Shoal differs, the item's
//! documentation says so.
//!
//! May not: touch files, processes, the network, the engine or the store.
//! Which template runs a task, where its output is written and how jobs are
//! numbered are decided by the callers; this crate only computes.

pub mod accounting;
pub mod array;
pub mod begin;
pub mod env;
pub mod export;
pub mod memory;
pub mod pattern;
pub mod script;
pub mod seff;
pub mod squeue_format;
pub mod time;

pub use accounting::{
    default_sacct_fields, format_rss, format_sacct, format_sacct_with, format_scontrol_job,
    format_squeue, format_squeue_custom, format_squeue_unfolded, format_submitted,
    long_sacct_fields, matches_job_refs, parse_format, parse_job_ref, parse_job_refs, parse_states,
    within_window, FieldSpec, JobRecord, JobRef, JobState, SacctField, SacctOptions, SacctStyle,
};
pub use array::{compress_ranges, parse_array, ArraySpec, MAX_ARRAY_TASKS};
pub use begin::parse_begin;
pub use env::{task_environment, ArrayTask, TaskDescription};
pub use export::exported_environment;
pub use memory::{format_mem_mib, parse_mem_mib};
pub use pattern::{
    default_output_pattern, expand_pattern, output_paths, OutputPaths, PatternContext,
    NO_VAL_TASK_ID,
};
pub use script::signal_number;
pub use script::{
    parse_script, parse_script_with_args, BatchScript, DepCondition, DepKind, Dependency,
    Directives, Refusal, ScriptWarning, TimeLimit, WarnSignal,
};
pub use time::{
    format_elapsed, format_squeue_time, format_total_cpu, parse_time_limit, round_up_to_minute,
};

/// Every error of this crate. Messages say what was wrong with the input;
/// a wrapped cause is reachable through [`std::error::Error::source`] and is
/// not repeated in the message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlurmError {
    /// An `--array` specification Slurm would also reject.
    #[error("invalid array specification {spec:?}: {reason}")]
    InvalidArray { spec: String, reason: String },
    /// A `--time` value that is none of Slurm's time formats.
    #[error("invalid time limit {value:?}: expected minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds or UNLIMITED")]
    InvalidTime { value: String },
    /// A `--mem`/`--mem-per-cpu` value `str_to_mbytes` would reject.
    #[error("invalid memory size {value:?}: expected a whole number with an optional K, M, G or T suffix (default M)")]
    InvalidMemory { value: String },
    /// A value that should have been a count (`--cpus-per-task`, `--nodes`, ...).
    #[error("invalid count {value:?}: {reason}")]
    InvalidCount { value: String, reason: String },
    /// A `--dependency` list that does not parse.
    #[error("invalid dependency {value:?}: {reason}")]
    InvalidDependency { value: String, reason: String },
    /// A job state name (`squeue -t`, `sacct -s`) Slurm does not have.
    #[error("invalid job state {value:?}: expected names such as PENDING, RUNNING, COMPLETED, FAILED, TIMEOUT, CANCELLED, OUT_OF_MEMORY or their short forms (PD, R, CD, F, TO, CA, OOM), or all")]
    InvalidState { value: String },
    /// An `--export` list that does not parse.
    #[error("invalid --export {value:?}: {reason}")]
    InvalidExport { value: String, reason: String },
    /// A job reference (`123`, `123_4`, `123_[1-3]`) that does not parse.
    #[error("invalid job id {value:?}: expected JOBID, JOBID_TASK or JOBID_[TASKS]")]
    InvalidJobRef { value: String },
    /// An option that needs a value was given none.
    #[error("{option} needs a value")]
    MissingValue { option: String },
    /// Two options that Slurm also refuses together.
    #[error("{0}")]
    Conflict(String),
    /// One directive (from the script or the command line) was invalid; the
    /// cause says how.
    #[error("{}{option}", line.map(|l| format!("line {l}: ")).unwrap_or_default())]
    Directive {
        line: Option<usize>,
        option: String,
        #[source]
        source: Box<SlurmError>,
    },
    /// The script asks for what a Shoal sandbox cannot give; each refusal
    /// says why.
    #[error("this job cannot run on Shoal: {}", .0.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("; "))]
    Refused(Vec<Refusal>),
    /// A `--format` field sacct does not know (sacct's own wording).
    #[error("Invalid field requested: {0:?}")]
    UnknownField(String),
    /// A `%N` width in a `--format` field that is not a number.
    #[error("invalid width in format field {0:?}")]
    InvalidWidth(String),
}
