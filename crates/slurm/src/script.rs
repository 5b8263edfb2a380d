//! Reading an `sbatch` script: its `#SBATCH` directives, its body, and what
//! in it a Shoal sandbox cannot do.
//!
//! Owns: the directive reader (sbatch's rules: `#SBATCH` lines are read
//! only until the first line that is neither blank nor a comment; long and
//! short options, `--opt=value` and `--opt value`, quotes, and trailing `#`
//! comments on a directive line), command-line options applied over the
//! script (as sbatch gives them precedence), the detection and neutralising
//! of environment-module lines (`module load ...`, `ml ...`, sourcing the
//! module system's init script), and the refusals: more than one node, GPUs,
//! MPI launchers, and `--ntasks` > 1 together with `srun`.
//!
//! The body is scanned with a small shell lexer (quotes, comments,
//! here-documents, `\` continuations, `;`, `&&`, `|`, `$(`...), so that a
//! word in a string, a comment or a here-document never counts as a
//! command.
//!
//! May not: run anything, read files, choose templates or assign job ids.

use std::fmt;
use std::ops::RangeInclusive;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::accounting::{parse_job_ref, JobRef};
use crate::array::{parse_array, ArraySpec};
use crate::memory::parse_mem_mib;
use crate::time::{parse_time_limit, round_up_to_minute};
use crate::SlurmError;

/// A `--time` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeLimit {
    /// `UNLIMITED`, `infinite`, `-1` or `0`.
    Unlimited,
    /// The duration as written (Slurm enforces it rounded up to a minute).
    Limit(Duration),
}

/// The kind of one `--dependency` condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DepKind {
    /// `after`: the jobs have started (or been cancelled).
    After,
    /// `afterany`: the jobs have ended, however.
    AfterAny,
    /// `afterok`: the jobs completed with exit code 0.
    AfterOk,
    /// `afternotok`: the jobs failed, timed out, were cancelled...
    AfterNotOk,
    /// `aftercorr`: each task waits for the same task id of the other array.
    AfterCorr,
    /// `singleton`: earlier jobs of the same name and user have ended.
    Singleton,
}

/// One `kind:job[:job...]` element of a `--dependency` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepCondition {
    pub kind: DepKind,
    /// Empty for `singleton`.
    pub jobs: Vec<JobRef>,
}

/// A parsed `--dependency`: every condition must hold (`,`), or any one
/// (`?`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dependency {
    pub conditions: Vec<DepCondition>,
    pub any: bool,
}

/// The options a job asked for, from its `#SBATCH` lines and the command
/// line. `None` means "not given".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Directives {
    /// `-J`, `--job-name`.
    pub job_name: Option<String>,
    /// `-a`, `--array`.
    pub array: Option<ArraySpec>,
    /// `-t`, `--time`.
    pub time: Option<TimeLimit>,
    /// `-o`, `--output` (a pattern; see [`crate::pattern`]).
    pub output: Option<String>,
    /// `-e`, `--error`.
    pub error: Option<String>,
    /// `--mem`, in MiB (0 is Slurm's "all of the node's memory").
    pub mem_mib: Option<u64>,
    /// `--mem-per-cpu`, in MiB.
    pub mem_per_cpu_mib: Option<u64>,
    /// `-c`, `--cpus-per-task`.
    pub cpus_per_task: Option<u32>,
    /// `-p`, `--partition`, as written (possibly a comma list).
    pub partition: Option<String>,
    /// `-N`, `--nodes`: the minimum node count.
    pub nodes: Option<u32>,
    /// `-n`, `--ntasks`.
    pub ntasks: Option<u32>,
    /// `--ntasks-per-node`.
    pub ntasks_per_node: Option<u32>,
    /// `--gres`, as written.
    pub gres: Option<String>,
    /// `--requeue` (true) / `--no-requeue` (false).
    pub requeue: Option<bool>,
    /// `-d`, `--dependency`.
    pub dependency: Option<Dependency>,
    /// `-A`, `--account`.
    pub account: Option<String>,
    /// `-D`, `--chdir` (or the older `--workdir`).
    pub chdir: Option<String>,
    /// `--parsable`: print only the job id on submission.
    pub parsable: bool,
    /// `--open-mode=append`: output files are appended to, not truncated.
    pub open_append: bool,
    /// `--hold`: submitted held, until `scontrol release`.
    pub hold: bool,
    /// `--begin`: not before this time (as given; `parse_begin` reads it).
    pub begin: Option<String>,
    /// `--signal`: a signal sent this many seconds before the time limit.
    pub signal: Option<WarnSignal>,
    /// `--export`: which of the submitting shell's variables the tasks get
    /// (`None`: ALL, as Slurm).
    pub export: Option<String>,
}

impl Directives {
    /// The job is an array.
    pub fn is_array(&self) -> bool {
        self.array.is_some()
    }

    /// vCPUs a task asks for: `--cpus-per-task`, else 1.
    pub fn cpus(&self) -> u32 {
        self.cpus_per_task.unwrap_or(1)
    }

    /// Memory a task asks for in MiB: `--mem`, or `--mem-per-cpu` times
    /// [`Directives::cpus`]; `None` when neither was given or `--mem=0`.
    pub fn memory_mib(&self) -> Option<u64> {
        match (self.mem_mib, self.mem_per_cpu_mib) {
            (Some(0), _) => None,
            (Some(m), _) => Some(m),
            (None, Some(per_cpu)) => Some(per_cpu.saturating_mul(u64::from(self.cpus()))),
            (None, None) => None,
        }
    }

    /// The limit Slurm would enforce: `--time` rounded up to a whole minute;
    /// `None` when unlimited or not given (the partition's default applies).
    pub fn time_limit(&self) -> Option<Duration> {
        match self.time {
            Some(TimeLimit::Limit(d)) => Some(round_up_to_minute(d)),
            _ => None,
        }
    }

    /// The partitions named, in order (`-p short,long` gives both).
    pub fn partitions(&self) -> Vec<&str> {
        self.partition
            .as_deref()
            .map(|p| {
                p.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The job's name: `--job-name`, else (as sbatch) the script's file
    /// name, else `sbatch` for a script read from standard input.
    pub fn job_name_or_default(&self, script_path: Option<&str>) -> String {
        if let Some(n) = &self.job_name {
            return n.clone();
        }
        script_path
            .and_then(|p| p.rsplit('/').find(|s| !s.is_empty()))
            .map(str::to_string)
            .unwrap_or_else(|| "sbatch".to_string())
    }
}

/// Something in the script Shoal reads differently from Slurm or ignores;
/// not an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScriptWarning {
    /// Line in the script (1-based); `None` for a command-line option.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ScriptWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "line {l}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// One reason a job cannot run on Shoal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// Line in the script (1-based); `None` for a command-line option.
    pub line: Option<usize>,
    /// What was asked, as written (`--nodes=4`, `mpirun`).
    pub what: String,
    /// Why a sandbox cannot give it.
    pub why: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.line {
            write!(f, "line {l}: ")?;
        }
        write!(f, "{}: {}", self.what, self.why)
    }
}

/// A parsed batch script.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchScript {
    pub directives: Directives,
    /// The script that runs in each task's sandbox: the original text, line
    /// for line (so shell error line numbers match the user's file), with
    /// each module command neutralised: a line holding only the command
    /// becomes `true  # shoal skipped: <line>`, and inside a longer line the
    /// word `module` becomes `true`.
    pub body: String,
    /// The interpreter from the `#!` line, without `#!` (`/bin/bash`).
    pub shebang: Option<String>,
    /// Module commands found and skipped: (line, text).
    pub module_lines: Vec<(usize, String)>,
    /// Lines that run `srun` (without MPI): (line, text). There is no
    /// `srun` in a sandbox unless the caller provides one.
    pub srun_lines: Vec<(usize, String)>,
    pub warnings: Vec<ScriptWarning>,
}

/// Parses a batch script's text. See [`parse_script_with_args`].
pub fn parse_script(text: &str) -> Result<BatchScript, SlurmError> {
    parse_script_with_args(text, &[])
}

/// Parses a batch script and applies `args` (sbatch options given on the
/// command line, e.g. `["--array=0-3", "-t", "10"]`) over its `#SBATCH`
/// directives, as sbatch does.
///
/// Errors: a directive or option whose value is invalid (the error names
/// the line and option, its source says what is wrong), and
/// [`SlurmError::Refused`] listing everything the job asks for that a
/// Shoal sandbox cannot give. Unknown options are warnings.
pub fn parse_script_with_args(text: &str, args: &[&str]) -> Result<BatchScript, SlurmError> {
    let scan = scan_body(text);
    let in_heredoc = |n: usize| scan.heredoc_lines.iter().any(|r| r.contains(&n));
    let mut p = OptionParser::default();
    let mut shebang = None;
    let mut in_header = true;

    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if n == 1 {
            if let Some(interp) = line.strip_prefix("#!") {
                shebang = Some(interp.trim().to_string());
                continue;
            }
        }
        let trimmed = line.trim_start();
        if let Some(rest) = line.strip_prefix("#SBATCH") {
            if in_header {
                let tokens = directive_tokens(rest);
                p.apply(&tokens, Some(n))?;
            } else if !in_heredoc(n) {
                p.warn(
                    Some(n),
                    "#SBATCH after the first command is ignored, as Slurm ignores it".into(),
                );
            }
            continue;
        }
        if trimmed.is_empty() {
            continue;
        }
        if trimmed.starts_with('#') {
            if in_header && trimmed.starts_with("#SBATCH") {
                p.warn(
                    Some(n),
                    "indented #SBATCH is a plain comment for Slurm and is ignored".into(),
                );
            }
            continue;
        }
        in_header = false;
    }
    p.end_source()?;
    if !args.is_empty() {
        let tokens: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        p.apply(&tokens, None)?;
        p.end_source()?;
    }
    if shebang.is_none() {
        p.warn(
            Some(1),
            "no #! line: Slurm would refuse this script (the interpreter is the caller's choice)"
                .into(),
        );
    }

    let mut refusals = std::mem::take(&mut p.refusals);
    refusals.extend(scan.mpi);

    let d = &p.directives;
    let tasks = d.ntasks.unwrap_or(1).max(d.ntasks_per_node.unwrap_or(1));
    if tasks > 1 {
        if let Some((line, _)) = scan.srun.first() {
            refusals.push(Refusal {
                line: Some(*line),
                what: format!("srun with --ntasks={tasks}"),
                why: format!(
                    "srun would start {tasks} cooperating copies of its command across the allocation; a Shoal task is one process tree in one sandbox"
                ),
            });
        } else {
            p.warnings.push(ScriptWarning {
                line: p.ntasks_line,
                message: format!(
                    "--ntasks={tasks} has no effect without srun: the script runs once per task, as on Slurm"
                ),
            });
        }
    }
    if !refusals.is_empty() {
        return Err(SlurmError::Refused(refusals));
    }

    let mut warnings = p.warnings;
    for (line, text) in &scan.modules {
        warnings.push(ScriptWarning {
            line: Some(*line),
            message: format!("skipped `{text}`: the template provides the software"),
        });
    }
    warnings.sort_by_key(|w| w.line.unwrap_or(usize::MAX));

    Ok(BatchScript {
        directives: p.directives,
        body: apply_edits(text, &scan.edits),
        shebang,
        module_lines: scan.modules,
        srun_lines: scan.srun,
        warnings,
    })
}

// ---------------------------------------------------------------------------
// Directives

/// Splits the rest of an `#SBATCH` line as sbatch's `_get_argument` does:
/// whitespace separates, quotes group (and are removed), a word starting
/// with `#` begins a comment.
fn directive_tokens(rest: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        match chars.peek() {
            None | Some('#') => break,
            _ => {}
        }
        let mut tok = String::new();
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() {
                break;
            }
            chars.next();
            if c == '"' || c == '\'' {
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    tok.push(q);
                }
            } else {
                tok.push(c);
            }
        }
        tokens.push(tok);
    }
    tokens
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Arg {
    Required,
    Optional,
    None,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Array,
    Account,
    Chdir,
    CpusPerTask,
    Dependency,
    Error,
    Output,
    Gres,
    Gpu,
    JobName,
    Mem,
    MemPerCpu,
    Nodes,
    Ntasks,
    NtasksPerNode,
    Partition,
    Requeue,
    NoRequeue,
    Time,
    Parsable,
    Export,
    Signal,
    OpenMode,
    Hold,
    Begin,
    Ignored(&'static str),
}

const NO_MAIL: &str = "Shoal sends no mail";
const PLACEMENT: &str = "Shoal places sandboxes itself";
const OWN_SANDBOX: &str = "each task has a sandbox to itself";
const NO_EFFECT: &str = "it has no effect on Shoal";

fn long_option(name: &str) -> Option<(Key, Arg)> {
    use Arg::*;
    use Key::*;
    Some(match name {
        "array" => (Array, Required),
        "account" => (Account, Required),
        "chdir" | "workdir" => (Chdir, Required),
        "cpus-per-task" => (CpusPerTask, Required),
        "dependency" => (Dependency, Required),
        "error" => (Error, Required),
        "output" => (Output, Required),
        "gres" => (Gres, Required),
        "gpus" | "gpus-per-node" | "gpus-per-task" | "gpus-per-socket" | "cpus-per-gpu"
        | "mem-per-gpu" | "gpu-bind" | "gpu-freq" => (Gpu, Required),
        "job-name" => (JobName, Required),
        "mem" => (Mem, Required),
        "mem-per-cpu" => (MemPerCpu, Required),
        "nodes" => (Nodes, Required),
        "ntasks" => (Ntasks, Required),
        "ntasks-per-node" => (NtasksPerNode, Required),
        "partition" => (Partition, Required),
        "requeue" => (Requeue, None),
        "no-requeue" => (NoRequeue, None),
        "time" => (Time, Required),
        "parsable" => (Parsable, None),
        "mail-type" | "mail-user" => (Ignored(NO_MAIL), Required),
        "qos" | "constraint" | "nodelist" | "exclude" | "reservation" | "clusters"
        | "cluster-constraint" | "prefer" | "switches" | "nodefile" => {
            (Ignored(PLACEMENT), Required)
        }
        "exclusive" => (Ignored(OWN_SANDBOX), Optional),
        "oversubscribe" | "overcommit" | "contiguous" | "spread-job" | "use-min-nodes" => {
            (Ignored(OWN_SANDBOX), None)
        }
        "export" => (Export, Required),
        "export-file" => (
            Ignored(
                "the task gets the SLURM_* variables, --export's and its template's environment",
            ),
            Required,
        ),
        "get-user-env" | "propagate" => (
            Ignored("the task gets the SLURM_* variables and its template's environment"),
            Optional,
        ),
        "hold" => (Hold, None),
        "begin" => (Begin, Required),
        "deadline" => (
            Ignored("a job is never cancelled for starting late"),
            Required,
        ),
        "signal" => (Signal, Required),
        "input" => (Ignored("standard input is /dev/null"), Required),
        "tmp" => (Ignored("disk space comes with the template"), Required),
        "open-mode" => (OpenMode, Required),
        "comment"
        | "wckey"
        | "licenses"
        | "time-min"
        | "priority"
        | "hint"
        | "mem-bind"
        | "cpu-bind"
        | "cpu-freq"
        | "distribution"
        | "core-spec"
        | "thread-spec"
        | "extra-node-info"
        | "sockets-per-node"
        | "cores-per-socket"
        | "threads-per-core"
        | "mincpus"
        | "ntasks-per-core"
        | "ntasks-per-socket"
        | "acctg-freq"
        | "profile"
        | "network"
        | "bb"
        | "bbf"
        | "uid"
        | "gid"
        | "kill-on-invalid-dep"
        | "delay-boot"
        | "container"
        | "container-id"
        | "gres-flags"
        | "batch"
        | "mcs-label"
        | "power"
        | "wrap"
        | "tres-per-task"
        | "tres-bind"
        | "segment"
        | "resv-ports" => (Ignored(NO_EFFECT), Required),
        "nice" | "no-kill" => (Ignored(NO_EFFECT), Optional),
        "quiet" | "verbose" | "wait" | "test-only" | "ignore-pbs" | "reboot" | "kill-command"
        | "requeue-hold" | "sockets" | "thread" | "spread" => (Ignored(NO_EFFECT), None),
        _ => return Option::None,
    })
}

fn short_option(c: char) -> Option<(Key, &'static str)> {
    use Key::*;
    Some(match c {
        'a' => (Array, "--array"),
        'A' => (Account, "--account"),
        'c' => (CpusPerTask, "--cpus-per-task"),
        'd' => (Dependency, "--dependency"),
        'D' => (Chdir, "--chdir"),
        'e' => (Error, "--error"),
        'G' => (Gpu, "--gpus"),
        'J' => (JobName, "--job-name"),
        'N' => (Nodes, "--nodes"),
        'n' => (Ntasks, "--ntasks"),
        'o' => (Output, "--output"),
        'p' => (Partition, "--partition"),
        't' => (Time, "--time"),
        'q' => (Ignored(PLACEMENT), "--qos"),
        'C' => (Ignored(PLACEMENT), "--constraint"),
        'w' => (Ignored(PLACEMENT), "--nodelist"),
        'x' => (Ignored(PLACEMENT), "--exclude"),
        'M' => (Ignored(PLACEMENT), "--clusters"),
        'F' => (Ignored(PLACEMENT), "--nodefile"),
        'i' => (Ignored("standard input is /dev/null"), "--input"),
        'b' => (Begin, "--begin"),
        'B' | 'L' | 'm' | 'S' => (Ignored(NO_EFFECT), "-"),
        _ => return None,
    })
}

/// Short options that take no value (sbatch's getopt string).
fn short_flag(c: char) -> Option<&'static str> {
    Some(match c {
        's' | 'O' => OWN_SANDBOX,
        'h' | 'I' | 'Q' | 'u' | 'v' | 'V' | 'W' | 'k' => NO_EFFECT,
        _ => return None,
    })
}

#[derive(Default)]
struct OptionParser {
    directives: Directives,
    warnings: Vec<ScriptWarning>,
    refusals: Vec<Refusal>,
    ntasks_line: Option<usize>,
    // Memory options seen in the current source (script, then command line).
    saw_mem: bool,
    saw_mem_per_cpu: bool,
}

impl OptionParser {
    fn warn(&mut self, line: Option<usize>, message: String) {
        self.warnings.push(ScriptWarning { line, message });
    }

    /// Ends one source of options: `--mem` and `--mem-per-cpu` together in
    /// it is the error Slurm reports.
    fn end_source(&mut self) -> Result<(), SlurmError> {
        let both = self.saw_mem && self.saw_mem_per_cpu;
        self.saw_mem = false;
        self.saw_mem_per_cpu = false;
        if both {
            return Err(SlurmError::Conflict(
                "--mem and --mem-per-cpu are mutually exclusive".into(),
            ));
        }
        Ok(())
    }

    fn apply(&mut self, tokens: &[String], line: Option<usize>) -> Result<(), SlurmError> {
        let mut i = 0;
        while i < tokens.len() {
            let tok = &tokens[i];
            i += 1;
            if let Some(long) = tok.strip_prefix("--") {
                let (name, inline) = match long.split_once('=') {
                    Some((n, v)) => (n, Some(v.to_string())),
                    None => (long, None),
                };
                let shown = format!("--{name}");
                match long_option(name) {
                    Some((key, arg)) => {
                        let value = match (arg, inline) {
                            (Arg::None, Some(_)) => {
                                return Err(directive_error(
                                    line,
                                    tok,
                                    SlurmError::Conflict(format!("{shown} takes no value")),
                                ))
                            }
                            (Arg::None, None) => None,
                            (_, Some(v)) => Some(v),
                            (Arg::Optional, None) => None,
                            (Arg::Required, None) => match tokens.get(i) {
                                Some(v) => {
                                    i += 1;
                                    Some(v.clone())
                                }
                                None => {
                                    return Err(directive_error(
                                        line,
                                        tok,
                                        SlurmError::MissingValue { option: shown },
                                    ))
                                }
                            },
                        };
                        let written = match &value {
                            Some(v) if arg != Arg::None => format!("{shown}={v}"),
                            _ => shown.clone(),
                        };
                        self.set(key, &shown, &written, value, line)?;
                    }
                    None => {
                        // Unknown: if a lone word follows, it is probably its value.
                        let mut written = tok.clone();
                        if inline.is_none() {
                            if let Some(v) = tokens.get(i).filter(|v| !v.starts_with('-')) {
                                written = format!("{tok} {v}");
                                i += 1;
                            }
                        }
                        self.warn(line, format!("unknown option {written} ignored"));
                    }
                }
            } else if let Some(short) = tok.strip_prefix('-').filter(|s| !s.is_empty()) {
                let mut chars = short.chars();
                let c = chars.next().expect("not empty");
                let attached: String = chars.collect();
                if let Some((key, long)) = short_option(c) {
                    let value = if !attached.is_empty() {
                        attached
                    } else if let Some(v) = tokens.get(i) {
                        i += 1;
                        v.clone()
                    } else {
                        return Err(directive_error(
                            line,
                            tok,
                            SlurmError::MissingValue {
                                option: format!("-{c}"),
                            },
                        ));
                    };
                    let shown = if long == "-" {
                        format!("-{c}")
                    } else {
                        long.to_string()
                    };
                    let written = format!("-{c} {value}");
                    self.set(key, &shown, &written, Some(value), line)?;
                } else if c == 'H' && attached.is_empty() {
                    self.set(Key::Hold, "--hold", "-H", None, line)?;
                } else if let Some(reason) = short_flag(c) {
                    self.warn(line, format!("{tok} ignored: {reason}"));
                } else {
                    self.warn(line, format!("unknown option {tok} ignored"));
                }
            } else {
                self.warn(line, format!("{tok:?} is not an option; ignored"));
            }
        }
        Ok(())
    }

    fn set(
        &mut self,
        key: Key,
        shown: &str,
        written: &str,
        value: Option<String>,
        line: Option<usize>,
    ) -> Result<(), SlurmError> {
        let wrap = |e: SlurmError| directive_error(line, written, e);
        let v = value.clone().unwrap_or_default();
        let d = &mut self.directives;
        match key {
            Key::Array => d.array = Some(parse_array(&v).map_err(wrap)?),
            Key::Account => d.account = Some(v),
            Key::Chdir => d.chdir = Some(v),
            Key::CpusPerTask => d.cpus_per_task = Some(parse_count(&v, 1).map_err(wrap)?),
            Key::Dependency => {
                d.dependency = if v.trim().is_empty() {
                    None
                } else {
                    Some(parse_dependency(&v).map_err(wrap)?)
                }
            }
            Key::Error => d.error = Some(non_empty(shown, v).map_err(wrap)?),
            Key::Output => d.output = Some(non_empty(shown, v).map_err(wrap)?),
            Key::JobName => d.job_name = Some(v),
            Key::Partition => d.partition = Some(non_empty(shown, v).map_err(wrap)?),
            Key::Mem => {
                d.mem_mib = Some(parse_mem_mib(&v).map_err(wrap)?);
                d.mem_per_cpu_mib = None;
                self.saw_mem = true;
            }
            Key::MemPerCpu => {
                d.mem_per_cpu_mib = Some(parse_mem_mib(&v).map_err(wrap)?);
                d.mem_mib = None;
                self.saw_mem_per_cpu = true;
            }
            Key::Nodes => {
                let min = parse_node_count(&v).map_err(wrap)?;
                d.nodes = Some(min);
                if min > 1 {
                    self.refusals.push(Refusal {
                        line,
                        what: written.to_string(),
                        why: "a Shoal task runs in one sandbox, on one machine; a job spanning several nodes cannot run (spread independent work with --array instead)".into(),
                    });
                } else if v.contains('-') || v.contains(',') {
                    self.warn(line, format!("{written}: each task gets exactly one node"));
                }
            }
            Key::Ntasks => {
                d.ntasks = Some(parse_count(&v, 1).map_err(wrap)?);
                self.ntasks_line = line;
            }
            Key::NtasksPerNode => {
                d.ntasks_per_node = Some(parse_count(&v, 1).map_err(wrap)?);
                self.ntasks_line = line;
            }
            Key::Gres => {
                d.gres = Some(v.clone());
                if names_gpu(&v) && !zero_count(&v) {
                    self.refusals.push(no_gpu(line, written));
                } else {
                    self.warn(line, format!("{written} ignored: {NO_EFFECT}"));
                }
            }
            Key::Gpu => {
                if !zero_count(&v) {
                    self.refusals.push(no_gpu(line, written));
                }
            }
            Key::Time => {
                d.time = Some(match parse_time_limit(&v).map_err(wrap)? {
                    Some(t) => TimeLimit::Limit(t),
                    None => TimeLimit::Unlimited,
                })
            }
            Key::Requeue => d.requeue = Some(true),
            Key::NoRequeue => d.requeue = Some(false),
            Key::Parsable => d.parsable = true,
            Key::Hold => d.hold = true,
            Key::Begin => {
                // Checked now; the time is taken from it at submit.
                crate::begin::parse_begin(&v, chrono::Local::now()).map_err(wrap)?;
                d.begin = Some(v.clone());
            }
            Key::Signal => d.signal = Some(parse_signal(&v).map_err(wrap)?),
            Key::OpenMode => {
                d.open_append = match v.to_ascii_lowercase().as_str() {
                    "append" | "a" => true,
                    "truncate" | "t" => false,
                    _ => {
                        return Err(wrap(SlurmError::InvalidCount {
                            value: v.clone(),
                            reason: "--open-mode is append or truncate".into(),
                        }))
                    }
                }
            }
            Key::Export => {
                // Checked now, so a bad list stops the submission.
                crate::export::exported_environment(Some(&v), std::iter::empty()).map_err(wrap)?;
                d.export = Some(v.clone());
            }
            Key::Ignored(reason) => self.warn(line, format!("{written} ignored: {reason}")),
        }
        Ok(())
    }
}

fn directive_error(line: Option<usize>, option: &str, source: SlurmError) -> SlurmError {
    SlurmError::Directive {
        line,
        option: option.to_string(),
        source: Box::new(source),
    }
}

fn no_gpu(line: Option<usize>, written: &str) -> Refusal {
    Refusal {
        line,
        what: written.to_string(),
        why: "Shoal sandboxes have no GPUs".into(),
    }
}

fn non_empty(option: &str, v: String) -> Result<String, SlurmError> {
    if v.trim().is_empty() {
        Err(SlurmError::MissingValue {
            option: option.to_string(),
        })
    } else {
        Ok(v)
    }
}

fn parse_count(v: &str, min: u32) -> Result<u32, SlurmError> {
    let bad = |reason: &str| SlurmError::InvalidCount {
        value: v.to_string(),
        reason: reason.to_string(),
    };
    let n: u32 = v
        .trim()
        .parse()
        .map_err(|_| bad("expected a whole number"))?;
    if n < min {
        return Err(bad(&format!("must be at least {min}")));
    }
    Ok(n)
}

/// The minimum of a `--nodes` value: `N`, `min-max`, `N,M,...` or
/// `min-max:step`, with Slurm's `k` (x1024) and `m` (x1048576) suffixes.
fn parse_node_count(v: &str) -> Result<u32, SlurmError> {
    let bad = || SlurmError::InvalidCount {
        value: v.to_string(),
        reason: "expected a node count such as 1 or 1-4".into(),
    };
    let first = v
        .trim()
        .split(['-', ',', ':'])
        .next()
        .filter(|s| !s.is_empty())
        .ok_or_else(bad)?;
    let (digits, mult) = match first.as_bytes().last() {
        Some(b'k' | b'K') => (&first[..first.len() - 1], 1024u64),
        Some(b'm' | b'M') => (&first[..first.len() - 1], 1024 * 1024),
        _ => (first, 1),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    u32::try_from(n * mult).map_err(|_| bad())
}

/// `--gres` names a GPU (`gpu`, `gpu:2`, `gpu:a100:1`, `gres/gpu:1`).
fn names_gpu(gres: &str) -> bool {
    gres.split(',').any(|item| {
        let name = item
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        name.contains("gpu")
    })
}

/// Every element of a GPU request asks for zero (`gpu:0`, `0`).
fn zero_count(v: &str) -> bool {
    v.split(',')
        .all(|item| item.rsplit(':').next().is_some_and(|c| c.trim() == "0"))
}

/// Parses `--dependency`: `afterok:123:456,afterany:789_2` (all must hold)
/// or `afterok:1?afternotok:2` (any one), and `singleton`.
fn parse_dependency(v: &str) -> Result<Dependency, SlurmError> {
    let bad = |reason: String| SlurmError::InvalidDependency {
        value: v.to_string(),
        reason,
    };
    let has_comma = v.contains(',');
    let has_q = v.contains('?');
    if has_comma && has_q {
        return Err(bad("use either , (all) or ? (any), not both".into()));
    }
    let sep = if has_q { '?' } else { ',' };
    let mut conditions = Vec::new();
    for item in v.split(sep) {
        let item = item.trim();
        if item.is_empty() {
            return Err(bad("empty condition".into()));
        }
        let mut parts = item.split(':');
        let kind_s = parts.next().unwrap_or("");
        let kind = match kind_s.to_ascii_lowercase().as_str() {
            "after" => DepKind::After,
            "afterany" => DepKind::AfterAny,
            "afterok" => DepKind::AfterOk,
            "afternotok" => DepKind::AfterNotOk,
            "aftercorr" => DepKind::AfterCorr,
            "singleton" => DepKind::Singleton,
            "expand" | "afterburstbuffer" => {
                return Err(bad(format!("{kind_s} is not supported on Shoal")))
            }
            _ => return Err(bad(format!("unknown dependency type {kind_s:?}"))),
        };
        let mut jobs = Vec::new();
        for j in parts {
            if j.contains('+') {
                return Err(bad(format!("delays ({j}) are not supported")));
            }
            jobs.push(parse_job_ref(j).map_err(|_| bad(format!("{j:?} is not a job id")))?);
        }
        match (kind, jobs.is_empty()) {
            (DepKind::Singleton, false) => return Err(bad("singleton takes no job ids".into())),
            (DepKind::Singleton, true) => {}
            (_, true) => return Err(bad(format!("{kind_s} needs at least one job id"))),
            _ => {}
        }
        conditions.push(DepCondition { kind, jobs });
    }
    Ok(Dependency {
        conditions,
        any: has_q,
    })
}

// ---------------------------------------------------------------------------
// Body

#[derive(Debug, Default)]
struct BodyScan {
    modules: Vec<(usize, String)>,
    srun: Vec<(usize, String)>,
    mpi: Vec<Refusal>,
    /// (byte range, replacement), ascending and disjoint.
    edits: Vec<(std::ops::Range<usize>, String)>,
    /// Lines inside here-documents.
    heredoc_lines: Vec<RangeInclusive<usize>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TokKind {
    Word,
    /// `;`, `&&`, `|`, `(`, `$(`, `` ` ``, ...: a new command follows.
    Separator,
    /// `>`, `2>&1`'s `>&`, `<<`: the next word is not a command.
    Redirect,
    /// The end of a `$(...)` or `` `...` `` substitution: the words after it
    /// belong to the command around it.
    Close,
    Newline,
}

#[derive(Debug, Clone)]
struct Tok {
    kind: TokKind,
    text: String,
    start: usize,
    end: usize,
    line: usize,
}

/// A small shell lexer: enough to find commands, not to run them. Also
/// returns the lines of here-document bodies.
fn lex(text: &str) -> (Vec<Tok>, Vec<RangeInclusive<usize>>) {
    let b = text.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let mut heredocs: Vec<(String, bool)> = Vec::new();
    let mut expect_heredoc_word: Option<bool> = None;
    // Open parentheses: true for a `$(` substitution.
    let mut parens: Vec<bool> = Vec::new();
    let mut in_backtick = false;
    let mut heredoc_lines = Vec::new();

    let mut word = String::new();
    let mut word_start: Option<(usize, usize)> = None;

    macro_rules! end_word {
        ($at:expr) => {
            if let Some((s, l)) = word_start.take() {
                let w = std::mem::take(&mut word);
                if let Some(dash) = expect_heredoc_word.take() {
                    let (delim, dash) = match w.strip_prefix('-') {
                        Some(d) if !dash => (d.to_string(), true),
                        _ => (w.clone(), dash),
                    };
                    heredocs.push((delim, dash));
                }
                toks.push(Tok {
                    kind: TokKind::Word,
                    text: w,
                    start: s,
                    end: $at,
                    line: l,
                });
            }
        };
    }

    while i < b.len() {
        let c = b[i];
        match c {
            b' ' | b'\t' | b'\r' => {
                end_word!(i);
                i += 1;
            }
            b'\n' => {
                end_word!(i);
                toks.push(Tok {
                    kind: TokKind::Newline,
                    text: "\n".into(),
                    start: i,
                    end: i + 1,
                    line,
                });
                i += 1;
                line += 1;
                // Here-document bodies follow the line that opened them.
                for (delim, dash) in std::mem::take(&mut heredocs) {
                    let first = line;
                    while i < b.len() {
                        let eol = text[i..].find('\n').map(|p| i + p).unwrap_or(b.len());
                        let l = &text[i..eol];
                        let l = if dash { l.trim_start_matches('\t') } else { l };
                        let done = l.trim_end_matches('\r') == delim;
                        i = (eol + 1).min(b.len());
                        line += 1;
                        if done {
                            break;
                        }
                    }
                    heredoc_lines.push(first..=line - 1);
                }
            }
            b'\\' => match text[i + 1..].chars().next() {
                // A line continuation joins the lines; it is not a word.
                Some('\n') => {
                    line += 1;
                    i += 2;
                }
                Some(ch) => {
                    word_start.get_or_insert((i, line));
                    word.push(ch);
                    i += 1 + ch.len_utf8();
                }
                None => i += 1,
            },
            b'#' if word_start.is_none() => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'\'' => {
                word_start.get_or_insert((i, line));
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    if b[i] == b'\n' {
                        line += 1;
                    }
                    let ch = text[i..].chars().next().expect("in bounds");
                    word.push(ch);
                    i += ch.len_utf8();
                }
                i += 1;
            }
            b'"' => {
                word_start.get_or_insert((i, line));
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    if b[i] == b'\\' && i + 1 < b.len() {
                        i += 1;
                    }
                    if b[i] == b'\n' {
                        line += 1;
                    }
                    let ch = text[i..].chars().next().expect("in bounds");
                    word.push(ch);
                    i += ch.len_utf8();
                }
                i += 1;
            }
            b'$' if b.get(i + 1) == Some(&b'{') => {
                // ${...} stays one word.
                word_start.get_or_insert((i, line));
                i = skip_balanced(text, i, '{', '}', &mut word, &mut line);
            }
            b'$' if text[i..].starts_with("$((") => {
                // $((...)) is arithmetic: one word, and its `<<` is a shift.
                word_start.get_or_insert((i, line));
                i = skip_balanced(text, i, '(', ')', &mut word, &mut line);
            }
            b'(' if text[i..].starts_with("((") && word_start.is_none() => {
                // The (( ... )) arithmetic command: no command inside.
                let mut ignored = String::new();
                let start = i;
                i = skip_balanced(text, i, '(', ')', &mut ignored, &mut line);
                toks.push(Tok {
                    kind: TokKind::Word,
                    text: "((".into(),
                    start,
                    end: i,
                    line,
                });
            }
            b'$' if b.get(i + 1) == Some(&b'(') => {
                end_word!(i);
                parens.push(true);
                toks.push(Tok {
                    kind: TokKind::Separator,
                    text: "$(".into(),
                    start: i,
                    end: i + 2,
                    line,
                });
                i += 2;
            }
            b'`' => {
                end_word!(i);
                let kind = if in_backtick {
                    TokKind::Close
                } else {
                    TokKind::Separator
                };
                in_backtick = !in_backtick;
                toks.push(Tok {
                    kind,
                    text: "`".into(),
                    start: i,
                    end: i + 1,
                    line,
                });
                i += 1;
            }
            b';' | b'&' | b'|' | b'(' | b')' | b'<' | b'>' => {
                end_word!(i);
                let start = i;
                while i < b.len() && matches!(b[i], b';' | b'&' | b'|' | b'(' | b')' | b'<' | b'>')
                {
                    i += 1;
                }
                let op = &text[start..i];
                let redirect = op.contains('<') || op.contains('>');
                if op.contains("<<") && !op.contains("<<<") {
                    let dash = b.get(i) == Some(&b'-');
                    if dash {
                        i += 1;
                    }
                    expect_heredoc_word = Some(dash);
                }
                let mut closes_substitution = false;
                for ch in op.chars() {
                    match ch {
                        '(' => parens.push(false),
                        ')' => closes_substitution = parens.pop().unwrap_or(false),
                        _ => {}
                    }
                }
                let kind = if op == ")" && closes_substitution {
                    TokKind::Close
                } else if redirect && !op.contains('|') && !op.contains(';') {
                    TokKind::Redirect
                } else {
                    TokKind::Separator
                };
                toks.push(Tok {
                    kind,
                    text: op.to_string(),
                    start,
                    end: i,
                    line,
                });
            }
            _ => {
                word_start.get_or_insert((i, line));
                let ch = text[i..].chars().next().expect("in bounds");
                word.push(ch);
                i += ch.len_utf8();
            }
        }
    }
    end_word!(b.len());
    (toks, heredoc_lines)
}

/// From an opening `open` at or after `i` to just past its matching
/// `close`, appending the text to `word` and counting lines.
fn skip_balanced(
    text: &str,
    mut i: usize,
    open: char,
    close: char,
    word: &mut String,
    line: &mut usize,
) -> usize {
    let mut depth = 0usize;
    for ch in text[i..].chars() {
        word.push(ch);
        i += ch.len_utf8();
        if ch == open {
            depth += 1;
        } else if ch == close {
            depth = depth.saturating_sub(1);
            if depth == 0 {
                break;
            }
        } else if ch == '\n' {
            *line += 1;
        }
    }
    i
}

/// One simple command: its words (redirection targets left out).
struct Command<'a> {
    /// Index in the token list of the command word.
    name: &'a Tok,
    args: Vec<&'a Tok>,
    /// First and last token of the whole command (prefixes and
    /// redirections included).
    first: &'a Tok,
    last: &'a Tok,
}

/// Reserved words after which a command follows.
const LEADING_KEYWORDS: &[&str] = &[
    "if", "then", "else", "elif", "while", "until", "do", "!", "{", "time",
];
/// Words that run the command after them.
const PREFIX_COMMANDS: &[&str] = &[
    "exec", "nohup", "command", "builtin", "env", "nice", "timeout", "stdbuf", "xargs",
];

fn commands(toks: &[Tok]) -> Vec<Command<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match toks[i].kind {
            TokKind::Newline | TokKind::Separator => {
                i += 1;
                continue;
            }
            TokKind::Close => {
                // Back in the command that held the substitution: what
                // follows are its arguments.
                i += 1;
                while i < toks.len()
                    && !matches!(toks[i].kind, TokKind::Newline | TokKind::Separator)
                {
                    i += 1;
                }
                continue;
            }
            TokKind::Word | TokKind::Redirect => {}
        }
        // Start of a command: find its name.
        let first_idx = i;
        let mut name_idx = None;
        let mut skip_duration = false;
        while i < toks.len() {
            let t = &toks[i];
            match t.kind {
                TokKind::Newline | TokKind::Separator | TokKind::Close => break,
                TokKind::Redirect => {
                    i += 2; // operator and its target
                    continue;
                }
                TokKind::Word => {
                    let w = t.text.as_str();
                    if name_idx.is_none() && (LEADING_KEYWORDS.contains(&w) || is_assignment(w)) {
                        i += 1;
                        continue;
                    }
                    if let Some(prev) = name_idx {
                        let p: &Tok = &toks[prev];
                        if !PREFIX_COMMANDS.contains(&base(&p.text)) {
                            break;
                        }
                        // After env, nohup, timeout...: skip options,
                        // assignments and timeout's duration.
                        if w.starts_with('-') || is_assignment(w) || skip_duration {
                            skip_duration = false;
                            i += 1;
                            continue;
                        }
                    }
                    name_idx = Some(i);
                    skip_duration = base(w) == "timeout";
                    i += 1;
                }
            }
        }
        let Some(n) = name_idx else {
            continue;
        };
        // Arguments up to the end of the command.
        let mut args = Vec::new();
        let mut j = n + 1;
        let mut last = n;
        while j < toks.len() {
            match toks[j].kind {
                TokKind::Newline | TokKind::Separator | TokKind::Close => break,
                TokKind::Redirect => {
                    last = (j + 1).min(toks.len() - 1);
                    j += 2;
                }
                TokKind::Word => {
                    args.push(&toks[j]);
                    last = j;
                    j += 1;
                }
            }
        }
        let name = &toks[n];
        if !matches!(
            name.text.as_str(),
            "for" | "case" | "select" | "function" | "in"
        ) {
            out.push(Command {
                name,
                args,
                first: &toks[first_idx],
                last: &toks[last.min(toks.len() - 1)],
            });
        }
        i = j;
    }
    out
}

fn is_assignment(w: &str) -> bool {
    match w.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && name
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        }
        None => false,
    }
}

fn base(w: &str) -> &str {
    w.rsplit('/').next().unwrap_or(w)
}

fn is_module_init(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    lower.contains("moduleshome")
        || lower.contains("lmod")
        || ((lower.contains("/etc/profile.d/") || lower.contains("/init/"))
            && lower.contains("module"))
}

fn scan_body(text: &str) -> BodyScan {
    let (toks, heredoc_lines) = lex(text);
    let line_starts: Vec<usize> = std::iter::once(0)
        .chain(text.match_indices('\n').map(|(i, _)| i + 1))
        .collect();
    let line_text = |l: usize| -> &str {
        let s = line_starts[l - 1];
        let e = line_starts.get(l).map(|e| e - 1).unwrap_or(text.len());
        &text[s..e]
    };
    let mut scan = BodyScan {
        heredoc_lines,
        ..Default::default()
    };
    for cmd in commands(&toks) {
        let name = base(&cmd.name.text);
        let line = cmd.name.line;
        let shown = line_text(line).trim().to_string();
        let arg_texts: Vec<&str> = cmd.args.iter().map(|a| a.text.as_str()).collect();
        let is_module = match name {
            "module" | "ml" => true,
            "source" | "." => arg_texts.first().is_some_and(|p| is_module_init(p)),
            _ => false,
        };
        if is_module {
            // The whole line, when the command is all there is on it.
            let first_line = cmd.first.line;
            let last_line = cmd.last.line;
            let ls = line_starts[first_line - 1];
            let indent = line_text(first_line).len() - line_text(first_line).trim_start().len();
            let le = ls + line_text(first_line).len();
            let alone = first_line == last_line
                && cmd.first.start == ls + indent
                && toks
                    .iter()
                    .find(|t| t.start >= cmd.last.end)
                    .is_none_or(|t| t.kind == TokKind::Newline);
            let line_shown = line_text(first_line).trim().to_string();
            if alone {
                let comment_free = line_shown.replace('\n', " ");
                scan.edits.push((
                    ls + indent..le,
                    format!("true  # shoal skipped: {comment_free}"),
                ));
            } else {
                scan.edits
                    .push((cmd.name.start..cmd.name.end, "true".to_string()));
            }
            scan.modules.push((first_line, line_shown));
            continue;
        }
        match name {
            "mpirun" | "mpiexec" | "mpiexec.hydra" | "orterun" | "ibrun" => scan.mpi.push(Refusal {
                line: Some(line),
                what: name.to_string(),
                why: "MPI needs cooperating processes on several nodes; a Shoal task is one sandbox on its own".into(),
            }),
            "srun" => {
                if let Some(mpi) = arg_texts.iter().position(|a| a.starts_with("--mpi")) {
                    let mut what = format!("srun {}", arg_texts[mpi]);
                    if arg_texts[mpi] == "--mpi" {
                        if let Some(v) = arg_texts.get(mpi + 1) {
                            what = format!("srun --mpi {v}");
                        }
                    }
                    scan.mpi.push(Refusal {
                        line: Some(line),
                        what,
                        why: "MPI needs cooperating processes on several nodes; a Shoal task is one sandbox on its own".into(),
                    });
                } else {
                    scan.srun.push((line, shown));
                }
            }
            _ => {}
        }
    }
    scan.edits.sort_by_key(|(r, _)| r.start);
    scan.edits.dedup_by(|b, a| b.0.start < a.0.end);
    scan
}

fn apply_edits(text: &str, edits: &[(std::ops::Range<usize>, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (range, replacement) in edits {
        out.push_str(&text[at..range.start]);
        out.push_str(replacement);
        at = range.end;
    }
    out.push_str(&text[at..]);
    out
}

/// `--signal=[{R|B}:]SIG[@TIME]`: `SIG` (a number or a name such as `USR1`
/// or `SIGUSR1`) sent `TIME` seconds (default 60, at most 65535) before the
/// time limit. Shoal signals the task's whole process group, so `B:` (the
/// batch shell only) and `R:` are accepted and mean the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarnSignal {
    pub signal: i32,
    pub before_seconds: u32,
}

/// Signal names sbatch(1) and kill(1) know, with their Linux numbers.
const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("TTIN", 21),
    ("TTOU", 22),
    ("URG", 23),
    ("XCPU", 24),
    ("XFSZ", 25),
    ("VTALRM", 26),
    ("PROF", 27),
    ("WINCH", 28),
    ("IO", 29),
    ("PWR", 30),
    ("SYS", 31),
];

/// A signal as kill(1) and `scancel --signal` take it: a name (`USR1`,
/// `SIGUSR1`) or a number 1 to 31. Returns the number and the bare name.
pub fn signal_number(value: &str) -> Result<(i32, String), SlurmError> {
    let invalid = || SlurmError::InvalidCount {
        value: value.to_owned(),
        reason: "a signal is a name (USR1, SIGTERM) or a number from 1 to 31".into(),
    };
    let upper = value.trim().to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    match bare.parse::<i32>() {
        Ok(n) if (1..=31).contains(&n) => Ok((
            n,
            SIGNALS
                .iter()
                .find(|(_, number)| *number == n)
                .map_or(n.to_string(), |(name, _)| (*name).to_owned()),
        )),
        Ok(_) => Err(invalid()),
        Err(_) => SIGNALS
            .iter()
            .find(|(n, _)| *n == bare)
            .map(|(name, number)| (*number, (*name).to_owned()))
            .ok_or_else(invalid),
    }
}

pub(crate) fn parse_signal(value: &str) -> Result<WarnSignal, SlurmError> {
    let invalid = |reason: &str| SlurmError::InvalidCount {
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let rest = value
        .strip_prefix("B:")
        .or_else(|| value.strip_prefix("R:"))
        .or_else(|| value.strip_prefix("RB:"))
        .or_else(|| value.strip_prefix("BR:"))
        .unwrap_or(value);
    let (name, time) = match rest.split_once('@') {
        Some((name, time)) => (name, Some(time)),
        None => (rest, None),
    };
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    let signal = match bare.parse::<i32>() {
        Ok(n) if (1..=31).contains(&n) => n,
        Ok(_) => return Err(invalid("a signal number is 1 to 31")),
        Err(_) => SIGNALS
            .iter()
            .find(|(n, _)| *n == bare)
            .map(|(_, number)| *number)
            .ok_or_else(|| invalid("expected [B:]SIGNAL[@SECONDS], e.g. USR1@120"))?,
    };
    if signal == 9 || signal == 19 {
        return Err(invalid(
            "KILL and STOP cannot be caught: a job could not act on them",
        ));
    }
    let before_seconds = match time {
        None => 60,
        Some(t) => t
            .parse::<u32>()
            .ok()
            .filter(|t| *t <= 65535)
            .ok_or_else(|| invalid("the time is 0 to 65535 seconds"))?,
    };
    Ok(WarnSignal {
        signal,
        before_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_takes_slurms_forms() {
        let sig = |v| parse_signal(v).map(|w| (w.signal, w.before_seconds));
        assert_eq!(sig("USR1"), Ok((10, 60)));
        assert_eq!(sig("B:SIGUSR2@120"), Ok((12, 120)));
        assert_eq!(sig("R:15@30"), Ok((15, 30)));
        assert_eq!(sig("term@0"), Ok((15, 0)));
        for bad in ["KILL", "9@10", "USR1@-1", "USR1@70000", "NOPE", "40"] {
            assert!(sig(bad).is_err(), "{bad}");
        }
    }

    const SHEBANG: &str = "#!/bin/bash\n";

    fn parse(s: &str) -> BatchScript {
        parse_script(s).unwrap_or_else(|e| panic!("{e}: {e:?}"))
    }

    fn refusals(s: &str) -> Vec<Refusal> {
        match parse_script(s) {
            Err(SlurmError::Refused(r)) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn long_options_both_forms() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --job-name=sweep\n#SBATCH --time 00:10:00\n#SBATCH --mem=4G\n#SBATCH --cpus-per-task 2\n#SBATCH --partition=short\n#SBATCH --output=logs/%x_%A_%a.out\n#SBATCH --error logs/%x_%A_%a.err\n#SBATCH --array=0-199%20\n#SBATCH --requeue\necho hi\n"
        ));
        let d = &s.directives;
        assert_eq!(d.job_name.as_deref(), Some("sweep"));
        assert_eq!(d.time, Some(TimeLimit::Limit(Duration::from_secs(600))));
        assert_eq!(d.mem_mib, Some(4096));
        assert_eq!(d.cpus_per_task, Some(2));
        assert_eq!(d.partition.as_deref(), Some("short"));
        assert_eq!(d.output.as_deref(), Some("logs/%x_%A_%a.out"));
        assert_eq!(d.error.as_deref(), Some("logs/%x_%A_%a.err"));
        let a = d.array.as_ref().unwrap();
        assert_eq!((a.count(), a.throttle), (200, Some(20)));
        assert_eq!(d.requeue, Some(true));
        assert_eq!(s.shebang.as_deref(), Some("/bin/bash"));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn short_options_separate_and_attached() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH -J fit -o out.%j -e err.%j -a 1-3 -t 30 -c 4 -p long -N 1 -n 1\n#SBATCH -t5\necho\n"
        ));
        let d = &s.directives;
        assert_eq!(d.job_name.as_deref(), Some("fit"));
        assert_eq!(d.output.as_deref(), Some("out.%j"));
        assert_eq!(d.error.as_deref(), Some("err.%j"));
        assert_eq!(d.array.as_ref().unwrap().task_ids, vec![1, 2, 3]);
        assert_eq!(
            d.time,
            Some(TimeLimit::Limit(Duration::from_secs(300))),
            "the later -t5 wins"
        );
        assert_eq!(d.cpus_per_task, Some(4));
        assert_eq!(d.partition.as_deref(), Some("long"));
        assert_eq!(d.nodes, Some(1));
        assert_eq!(d.ntasks, Some(1));
    }

    #[test]
    fn directives_stop_at_the_first_command() {
        let s = parse(&format!(
            "{SHEBANG}# a comment\n\n#SBATCH -J one\nset -e\n#SBATCH -J two\necho\n"
        ));
        assert_eq!(s.directives.job_name.as_deref(), Some("one"));
        assert!(s
            .warnings
            .iter()
            .any(|w| w.line == Some(6) && w.message.contains("after the first command")));
    }

    #[test]
    fn trailing_comments_and_quotes_on_directive_lines() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --mem=50G          # Job memory request\n#SBATCH --job-name=\"my job\"   # name\n#SBATCH --output='a b.out'\ntrue\n"
        ));
        assert_eq!(s.directives.mem_mib, Some(50 * 1024));
        assert_eq!(s.directives.job_name.as_deref(), Some("my job"));
        assert_eq!(s.directives.output.as_deref(), Some("a b.out"));
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn disabled_and_indented_directives() {
        let s = parse(&format!(
            "{SHEBANG}##SBATCH --nodes=8\n  #SBATCH -J x\ntrue\n"
        ));
        assert_eq!(s.directives.nodes, None, "##SBATCH is a comment");
        assert_eq!(s.directives.job_name, None);
        assert!(s
            .warnings
            .iter()
            .any(|w| w.line == Some(3) && w.message.contains("indented")));
    }

    #[test]
    fn unknown_and_ignored_options_warn() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --mail-type=END,FAIL\n#SBATCH --mail-user me@example.org\n#SBATCH --frobnicate=3\n#SBATCH --wibble 7\n#SBATCH --exclusive\n#SBATCH -q normal\n#SBATCH -Z\ntrue\n"
        ));
        let w: Vec<String> = s.warnings.iter().map(|w| w.to_string()).collect();
        assert!(
            w[0].starts_with("line 2: --mail-type=END,FAIL ignored: Shoal sends no mail"),
            "{w:?}"
        );
        assert!(w[1].contains("--mail-user=me@example.org ignored"), "{w:?}");
        assert!(
            w[2].contains("unknown option --frobnicate=3 ignored"),
            "{w:?}"
        );
        assert!(w[3].contains("unknown option --wibble 7 ignored"), "{w:?}");
        assert!(
            w[4].contains("--exclusive ignored: each task has a sandbox to itself"),
            "{w:?}"
        );
        assert!(
            w[5].contains("--qos ignored") || w[5].contains("-q normal ignored"),
            "{w:?}"
        );
        assert!(w[6].contains("unknown option -Z"), "{w:?}");
        assert_eq!(w.len(), 7);
    }

    #[test]
    fn no_requeue_and_dependency() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --no-requeue\n#SBATCH --dependency=afterok:123:456_7\ntrue\n"
        ));
        assert_eq!(s.directives.requeue, Some(false));
        let dep = s.directives.dependency.unwrap();
        assert!(!dep.any);
        assert_eq!(dep.conditions.len(), 1);
        assert_eq!(dep.conditions[0].kind, DepKind::AfterOk);
        assert_eq!(
            dep.conditions[0].jobs,
            vec![
                JobRef {
                    job_id: 123,
                    task_id: None
                },
                JobRef {
                    job_id: 456,
                    task_id: Some(7)
                }
            ]
        );
    }

    #[test]
    fn dependency_forms() {
        let d = parse_dependency("afterok:1,afterany:2").unwrap();
        assert_eq!(d.conditions.len(), 2);
        assert!(!d.any);
        let d = parse_dependency("afterok:1?afternotok:2").unwrap();
        assert!(d.any);
        assert_eq!(d.conditions[1].kind, DepKind::AfterNotOk);
        assert_eq!(
            parse_dependency("singleton").unwrap().conditions[0].kind,
            DepKind::Singleton
        );
        assert_eq!(
            parse_dependency("aftercorr:9").unwrap().conditions[0].kind,
            DepKind::AfterCorr
        );
        assert_eq!(
            parse_dependency("AFTEROK:5").unwrap().conditions[0].kind,
            DepKind::AfterOk
        );
        for bad in [
            "afterok",
            "afterok:",
            "afterok:x",
            "later:1",
            "afterok:1,afterany:2?after:3",
            "after:1+10",
            "singleton:3",
            "expand:4",
            "",
        ] {
            assert!(parse_dependency(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn invalid_values_name_line_and_option() {
        let e = parse_script(&format!(
            "{SHEBANG}#SBATCH -J x\n#SBATCH --time=abc\ntrue\n"
        ))
        .unwrap_err();
        assert_eq!(e.to_string(), "line 3: --time=abc");
        assert!(
            matches!(&e, SlurmError::Directive { source, .. } if matches!(**source, SlurmError::InvalidTime { .. }))
        );
        let cause = std::error::Error::source(&e).unwrap().to_string();
        assert!(
            cause.starts_with("invalid time limit \"abc\": expected minutes"),
            "{cause}"
        );
        let e = parse_script(&format!("{SHEBANG}#SBATCH --array=5-1\n")).unwrap_err();
        assert!(
            matches!(&e, SlurmError::Directive { line: Some(2), source, .. } if matches!(**source, SlurmError::InvalidArray { .. }))
        );
        let e = parse_script(&format!("{SHEBANG}#SBATCH --mem=lots\n")).unwrap_err();
        assert!(
            matches!(&e, SlurmError::Directive { source, .. } if matches!(**source, SlurmError::InvalidMemory { .. }))
        );
        let e = parse_script(&format!("{SHEBANG}#SBATCH -c 0\n")).unwrap_err();
        assert!(
            matches!(&e, SlurmError::Directive { source, .. } if matches!(**source, SlurmError::InvalidCount { .. }))
        );
        let e = parse_script(&format!("{SHEBANG}#SBATCH --job-name\n")).unwrap_err();
        assert!(
            matches!(&e, SlurmError::Directive { source, .. } if matches!(**source, SlurmError::MissingValue { .. }))
        );
        let e = parse_script(&format!("{SHEBANG}#SBATCH --requeue=yes\n")).unwrap_err();
        assert!(matches!(&e, SlurmError::Directive { .. }));
        let e = parse_script(&format!("{SHEBANG}#SBATCH --output=\n")).unwrap_err();
        assert!(matches!(&e, SlurmError::Directive { .. }));
    }

    #[test]
    fn mem_and_mem_per_cpu() {
        let e = parse_script(&format!(
            "{SHEBANG}#SBATCH --mem=1G\n#SBATCH --mem-per-cpu=1G\n"
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "--mem and --mem-per-cpu are mutually exclusive"
        );
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --mem-per-cpu=2G\n#SBATCH -c 4\ntrue\n"
        ));
        assert_eq!(s.directives.memory_mib(), Some(8192));
        // The command line replaces the script's memory option.
        let s = parse_script_with_args(
            &format!("{SHEBANG}#SBATCH --mem-per-cpu=2G\ntrue\n"),
            &["--mem=1G"],
        )
        .unwrap();
        assert_eq!(
            (s.directives.mem_mib, s.directives.mem_per_cpu_mib),
            (Some(1024), None)
        );
        let s = parse(&format!("{SHEBANG}#SBATCH --mem=0\ntrue\n"));
        assert_eq!(
            s.directives.memory_mib(),
            None,
            "--mem=0 asks for no particular size"
        );
    }

    #[test]
    fn command_line_overrides_the_script() {
        let s = parse_script_with_args(
            &format!("{SHEBANG}#SBATCH --array=0-9\n#SBATCH -J script\ntrue\n"),
            &["--array=0-3", "-J", "cli", "--parsable"],
        )
        .unwrap();
        assert_eq!(s.directives.array.as_ref().unwrap().count(), 4);
        assert_eq!(s.directives.job_name.as_deref(), Some("cli"));
        assert!(s.directives.parsable);
        let e = parse_script_with_args(&format!("{SHEBANG}true\n"), &["--time=x"]).unwrap_err();
        assert_eq!(e.to_string(), "--time=x", "no line for the command line");
    }

    #[test]
    fn helpers() {
        let d = Directives {
            time: Some(TimeLimit::Limit(Duration::from_secs(90))),
            partition: Some("short, long".into()),
            ..Default::default()
        };
        assert_eq!(
            d.time_limit(),
            Some(Duration::from_secs(120)),
            "rounded up to a minute"
        );
        assert_eq!(d.partitions(), vec!["short", "long"]);
        assert_eq!(d.cpus(), 1);
        assert!(!d.is_array());
        assert_eq!(d.job_name_or_default(Some("/home/a/jobs/run.sh")), "run.sh");
        assert_eq!(d.job_name_or_default(None), "sbatch");
        let unl = Directives {
            time: Some(TimeLimit::Unlimited),
            ..Default::default()
        };
        assert_eq!(unl.time_limit(), None);
    }

    #[test]
    fn missing_shebang_warns() {
        let s = parse("#SBATCH -J x\necho hi\n");
        assert_eq!(s.shebang, None);
        assert_eq!(
            s.directives.job_name.as_deref(),
            Some("x"),
            "directives still read"
        );
        assert!(s.warnings.iter().any(|w| w.message.contains("#!")));
    }

    #[test]
    fn module_lines_are_reported_and_neutralised() {
        let text = format!(
            "{SHEBANG}#SBATCH -J m\nmodule purge\n  module load python/3.11 gcc/12\nmodule load cuda 2>/dev/null || true\nml R\nsource /etc/profile.d/modules.sh\necho done\n"
        );
        let s = parse(&text);
        assert_eq!(
            s.module_lines,
            vec![
                (3, "module purge".to_string()),
                (4, "module load python/3.11 gcc/12".to_string()),
                (5, "module load cuda 2>/dev/null || true".to_string()),
                (6, "ml R".to_string()),
                (7, "source /etc/profile.d/modules.sh".to_string()),
            ]
        );
        let lines: Vec<&str> = s.body.lines().collect();
        assert_eq!(lines.len(), text.lines().count(), "line numbers are kept");
        assert_eq!(lines[2], "true  # shoal skipped: module purge");
        assert_eq!(
            lines[3],
            "  true  # shoal skipped: module load python/3.11 gcc/12"
        );
        assert_eq!(
            lines[4], "true load cuda 2>/dev/null || true",
            "a longer line keeps its other commands"
        );
        assert_eq!(lines[5], "true  # shoal skipped: ml R");
        assert_eq!(
            lines[6],
            "true  # shoal skipped: source /etc/profile.d/modules.sh"
        );
        assert_eq!(lines[7], "echo done");
        assert_eq!(lines[0], "#!/bin/bash");
        assert!(
            s.warnings
                .iter()
                .filter(|w| w.message.contains("template provides"))
                .count()
                == 5
        );
    }

    #[test]
    fn module_commands_inside_other_commands() {
        let s = parse(&format!(
            "{SHEBANG}if true; then module load x; fi\nmodule load a \\\n  b\nmodule load y && echo ok\n"
        ));
        let lines: Vec<&str> = s.body.lines().collect();
        assert_eq!(lines[1], "if true; then true load x; fi");
        assert_eq!(
            lines[2], "true load a \\",
            "a continued command keeps its continuation"
        );
        assert_eq!(lines[3], "  b");
        assert_eq!(lines[4], "true load y && echo ok");
        assert_eq!(
            s.module_lines.iter().map(|m| m.0).collect::<Vec<_>>(),
            vec![2, 3, 5]
        );
    }

    #[test]
    fn module_words_that_are_not_commands_stay() {
        let text = format!(
            "{SHEBANG}echo module load x\n# module load y\npython - <<EOF\nmodule = 3\nEOF\necho \"module\"\nsource ./env.sh\n"
        );
        let s = parse(&text);
        assert!(s.module_lines.is_empty(), "{:?}", s.module_lines);
        assert_eq!(s.body, text);
    }

    #[test]
    fn nodes_refused() {
        let r = refusals(&format!("{SHEBANG}#SBATCH --nodes=4\ntrue\n"));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].line, Some(2));
        assert_eq!(r[0].what, "--nodes=4");
        assert!(r[0].why.contains("one sandbox"));
        let r = refusals(&format!("{SHEBANG}#SBATCH -N 2\ntrue\n"));
        assert_eq!(r[0].what, "-N 2");
        let r = refusals(&format!("{SHEBANG}#SBATCH -N2-4\ntrue\n"));
        assert_eq!(r.len(), 1);
        let s = parse(&format!("{SHEBANG}#SBATCH --nodes=1-4\ntrue\n"));
        assert!(s
            .warnings
            .iter()
            .any(|w| w.message.contains("exactly one node")));
        assert_eq!(s.directives.nodes, Some(1));
        let r = refusals(&format!("{SHEBANG}#SBATCH --nodes=1k\ntrue\n"));
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn gpus_refused() {
        for d in [
            "--gres=gpu:2",
            "--gres=gpu",
            "--gres=gpu:a100:1",
            "--gres=tmpfs:1,gpu:1",
            "--gpus=1",
            "-G 2",
            "--gpus-per-task=1",
            "--mem-per-gpu=8G",
        ] {
            let r = refusals(&format!("{SHEBANG}#SBATCH {d}\ntrue\n"));
            assert_eq!(r.len(), 1, "{d}");
            assert!(r[0].why.contains("no GPUs"), "{d}");
        }
        let s = parse(&format!(
            "{SHEBANG}#SBATCH --gres=gpu:0\n#SBATCH --gres=tmpfs:10G\ntrue\n"
        ));
        assert_eq!(s.directives.gres.as_deref(), Some("tmpfs:10G"));
    }

    #[test]
    fn mpi_refused() {
        let r = refusals(&format!(
            "{SHEBANG}#SBATCH -n 1\nmodule load openmpi\nmpirun -np 4 ./a.out\nsrun --mpi=pmix ./b\nsrun --mpi pmi2 ./c\n/opt/bin/mpiexec ./d\nFOO=1 mpiexec.hydra ./e\n"
        ));
        let lines: Vec<_> = r
            .iter()
            .map(|r| (r.line.unwrap(), r.what.as_str()))
            .collect();
        assert_eq!(
            lines,
            vec![
                (4, "mpirun"),
                (5, "srun --mpi=pmix"),
                (6, "srun --mpi pmi2"),
                (7, "mpiexec"),
                (8, "mpiexec.hydra")
            ]
        );
        assert!(r[0].why.contains("MPI"));
        let e = parse_script(&format!("{SHEBANG}mpirun x\n"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("this job cannot run on Shoal: line 2: mpirun: MPI needs"),
            "{e}"
        );
    }

    #[test]
    fn mpi_words_that_are_not_commands_are_fine() {
        let s = parse(&format!(
            "{SHEBANG}echo \"run mpirun later\"\necho mpirun\n# mpirun -np 4\ncat <<'EOS' > other.sh\nmpirun -np 8 x\nsrun --mpi=pmix y\nEOS\nwhich mpirun || true\n"
        ));
        assert!(s.srun_lines.is_empty());
    }

    #[test]
    fn srun_with_several_tasks_refused() {
        let r = refusals(&format!("{SHEBANG}#SBATCH --ntasks=8\nsrun python x.py\n"));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].line, Some(3));
        assert!(r[0].what.contains("--ntasks=8"));
        let r = refusals(&format!(
            "{SHEBANG}#SBATCH --ntasks-per-node=4\nsrun python x.py\n"
        ));
        assert_eq!(r.len(), 1);
        // One task and srun: fine, reported.
        let s = parse(&format!(
            "{SHEBANG}#SBATCH -n 1\nsrun python x.py\ntime srun ./y\n"
        ));
        assert_eq!(
            s.srun_lines,
            vec![
                (3, "srun python x.py".to_string()),
                (4, "time srun ./y".to_string())
            ]
        );
        // Several tasks without srun: a warning.
        let s = parse(&format!("{SHEBANG}#SBATCH --ntasks=4\npython x.py\n"));
        assert!(s
            .warnings
            .iter()
            .any(|w| w.line == Some(2) && w.message.contains("no effect without srun")));
    }

    #[test]
    fn every_refusal_is_listed() {
        let r = refusals(&format!(
            "{SHEBANG}#SBATCH -N 2\n#SBATCH --gres=gpu:1\nmpirun x\n"
        ));
        assert_eq!(r.len(), 3);
        let e = SlurmError::Refused(r).to_string();
        assert!(
            e.contains("; line 3: --gres=gpu:1: Shoal sandboxes have no GPUs; "),
            "{e}"
        );
    }

    #[test]
    fn lexer_commands() {
        let (toks, _) = lex("a=1 b c | d && e; f $(g h) `i` x > out y\n");
        let names: Vec<String> = commands(&toks)
            .iter()
            .map(|c| c.name.text.clone())
            .collect();
        assert_eq!(names, vec!["b", "d", "e", "f", "g", "i"]);
        let (toks, _) = lex("x=$(srun a) && y=`mpirun b` ; ( cd d; srun c ) ; echo $( (z) ) w\n");
        let names: Vec<String> = commands(&toks)
            .iter()
            .map(|c| c.name.text.clone())
            .collect();
        assert_eq!(names, vec!["srun", "mpirun", "cd", "srun", "echo", "z"]);
        let (toks, _) = lex("timeout 10 srun x\nenv -i A=1 mpirun y\nnohup srun z &\n");
        let names: Vec<String> = commands(&toks)
            .iter()
            .map(|c| c.name.text.clone())
            .collect();
        assert_eq!(names, vec!["srun", "mpirun", "srun"]);
        let (toks, _) =
            lex("for m in module srun; do echo $m; done\ncase $x in a) srun q;; esac\n");
        let names: Vec<String> = commands(&toks)
            .iter()
            .map(|c| c.name.text.clone())
            .collect();
        assert!(!names.contains(&"module".to_string()), "{names:?}");
        assert!(names.contains(&"srun".to_string()), "{names:?}");
    }

    #[test]
    fn escapes_and_continuations() {
        let words = |src: &str| -> Vec<String> {
            lex(src)
                .0
                .into_iter()
                .filter(|t| t.kind == TokKind::Word)
                .map(|t| t.text)
                .collect()
        };
        assert_eq!(words("echo \\\"ab c\n"), vec!["echo", "\"ab", "c"]);
        assert_eq!(words("echo \\é x\n"), vec!["echo", "é", "x"]);
        assert_eq!(words("a \\\n  b\n"), vec!["a", "b"], "no empty word");
        assert_eq!(words("a\\\nb\n"), vec!["ab"]);
        let r = refusals(&format!("{SHEBANG}echo \\\"hi\\\" ; mpirun y\n"));
        assert_eq!(r[0].line, Some(2));
    }

    #[test]
    fn arithmetic_shifts_are_not_here_documents() {
        let r = refusals(&format!("{SHEBANG}x=$(( 1 << 2 ))\nmpirun y\n"));
        assert_eq!((r[0].line, r[0].what.as_str()), (Some(3), "mpirun"));
        let s = parse(&format!(
            "{SHEBANG}(( n <<= 1 ))\nmodule load z\necho ${{a:-<<}}\n"
        ));
        assert_eq!(s.module_lines, vec![(3, "module load z".to_string())]);
    }

    #[test]
    fn sbatch_lines_in_here_documents_are_not_warned_about() {
        let s = parse(&format!(
            "{SHEBANG}#SBATCH -J a\ncat > b.sh <<EOF\n#!/bin/bash\n#SBATCH -N 8\nEOF\n#SBATCH -J late\n"
        ));
        let late: Vec<_> = s
            .warnings
            .iter()
            .filter(|w| w.message.contains("after the first command"))
            .collect();
        assert_eq!(late.len(), 1, "{:?}", s.warnings);
        assert_eq!(late[0].line, Some(7));
        assert_eq!(s.directives.nodes, None);
    }

    #[test]
    fn multi_line_strings_do_not_confuse_line_numbers() {
        let s = parse(&format!(
            "{SHEBANG}python -c \"\nimport os\nprint(1)\n\"\nmodule load x\n"
        ));
        assert_eq!(s.module_lines, vec![(6, "module load x".to_string())]);
    }

    #[test]
    fn non_ascii_text_is_kept() {
        let text = format!("{SHEBANG}echo \"héllo → wörld\" # ç\nmodule load é\n");
        let s = parse(&text);
        assert!(s.body.contains("héllo → wörld"));
        assert_eq!(s.module_lines, vec![(3, "module load é".to_string())]);
    }

    #[test]
    fn hold_and_begin_are_kept_and_checked() {
        let s = parse_script_with_args("#!/bin/sh\n#SBATCH --begin=now+1hour\ntrue\n", &["-H"])
            .unwrap();
        assert!(s.directives.hold);
        assert_eq!(s.directives.begin.as_deref(), Some("now+1hour"));
        let s = parse_script_with_args("#!/bin/sh\ntrue\n", &["-b", "16:00", "--hold"]).unwrap();
        assert!(s.directives.hold);
        assert_eq!(s.directives.begin.as_deref(), Some("16:00"));
        assert!(parse_script_with_args("#!/bin/sh\ntrue\n", &["--begin=whenever"]).is_err());
        assert!(
            !parse_script_with_args("#!/bin/sh\ntrue\n", &[])
                .unwrap()
                .directives
                .hold
        );
    }
}
