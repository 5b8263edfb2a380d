//! `shoal sbatch`: reads a batch script and its command-line options,
//! refuses what the fleet cannot do, picks a template, and submits the job
//! as one sweep (a cell per array task).
//!
//! Owns: splitting sbatch's argument list into options, script and script
//! arguments; the choice of template (`--partition` through the
//! configured map, else the default template, else the smallest one that
//! has the `--cpus-per-task`/`--mem` asked for, with a warning when none
//! has); the sweep request (the script is written into each sandbox and
//! run from a directory of the same path as the submit directory); what
//! sbatch prints. Following the job to write its output files is
//! `follow.rs`'s.
//!
//! May not: parse `#SBATCH` lines itself (that is `shoal_slurm`'s), write
//! output files, or talk to anything but the API.

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use serde_json::{json, Value};
use shoal_slurm::{BatchScript, DepKind, Directives, SlurmError, TimeLimit};
use std::path::{Path, PathBuf};

use super::api::Api;
use super::config::Config;

/// Where the script is written in each sandbox (outside the submit
/// directory, so it is never collected back).
pub const SCRIPT_PATH: &str = "/tmp/shoal-slurm/job.sh";
/// Where a task finds `srun` (first on its `PATH`): one step of one task
/// in the task's own sandbox (`srun.sh`).
pub const SRUN_DIR: &str = "/tmp/shoal-slurm/bin";
const SRUN: &str = include_str!("srun.sh");

/// `--time` not given: Slurm takes the partition's default; Shoal's is an hour.
const DEFAULT_TIME_SECONDS: u64 = 3600;
/// Seconds between SIGTERM and SIGKILL at the time limit: Slurm's default
/// KillWait.
const KILL_WAIT_SECONDS: u64 = 30;
/// `--time=UNLIMITED`: the longest a sweep's attempt may run.
const UNLIMITED_TIME_SECONDS: u64 = 30 * 86400;

/// sbatch's arguments, split.
#[derive(Debug, Default, PartialEq)]
pub struct Invocation {
    /// Options given before the script, as sbatch takes them.
    pub options: Vec<String>,
    /// `--wait` / `-W`: follow the job in the foreground.
    pub wait: bool,
    /// The script; `None` reads standard input.
    pub script: Option<String>,
    /// Arguments after the script: `$1`...
    pub script_args: Vec<String>,
    /// `--wrap CMD`: the script is `#!/bin/sh` and CMD.
    pub wrap: Option<String>,
    /// `--test-only`: check and say what would run, submit nothing.
    pub test_only: bool,
    /// `--prelude FILE`: run once per job; every task forks from it.
    pub prelude: Option<String>,
    /// `--keep-failed[=TIME]`: keep a failed task's sandbox (hibernated)
    /// for `shoal debug`; the value as given (`""`: the default).
    pub keep_failed: Option<String>,
    /// `--shoal-input PATH`: more inputs than the submit directory
    /// (`--input` is sbatch's standard input).
    pub inputs: Vec<String>,
}

/// Long options that take no value (every other long option does, unless
/// written `--opt=value`).
const LONG_FLAGS: &[&str] = &[
    "requeue",
    "no-requeue",
    "parsable",
    "wait",
    "quiet",
    "verbose",
    "test-only",
    "ignore-pbs",
    "reboot",
    "hold",
    "oversubscribe",
    "overcommit",
    "contiguous",
    "spread-job",
    "use-min-nodes",
    "exclusive",
    "get-user-env",
    "propagate",
    "nice",
    "no-kill",
    "kill-command",
    "requeue-hold",
];
/// Short options that take no value (sbatch's getopt string).
const SHORT_FLAGS: &str = "HsOhIQuvVWk";

/// Splits `sbatch [options] [script [args...]]`: the first word that is
/// not an option or an option's value is the script.
pub fn split_args(args: &[String]) -> Invocation {
    let mut inv = Invocation::default();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        if a == "--wait" || a == "-W" {
            inv.wait = true;
            continue;
        }
        if a == "--test-only" {
            inv.test_only = true;
            continue;
        }
        // sbatch's and Shoal's own options that take a value, as `--opt=V`
        // or `--opt V`: `Some(value)` when given (the value `None` when it
        // is missing at the end of the line).
        let mut value_of = |name: &str| -> Option<Option<String>> {
            if let Some(v) = a.strip_prefix(&format!("--{name}=")) {
                return Some(Some(v.to_owned()));
            }
            if a == &format!("--{name}") {
                i += 1;
                return Some(args.get(i - 1).cloned());
            }
            None
        };
        if let Some(cmd) = value_of("wrap") {
            inv.wrap = cmd;
            continue;
        }
        if let Some(path) = value_of("prelude") {
            inv.prelude = path;
            continue;
        }
        if let Some(path) = value_of("shoal-input") {
            inv.inputs.extend(path);
            continue;
        }
        // `--keep-failed` alone takes no value (the default time).
        if a == "--keep-failed" {
            inv.keep_failed = Some(String::new());
            continue;
        }
        if let Some(time) = a.strip_prefix("--keep-failed=") {
            inv.keep_failed = Some(time.to_owned());
            continue;
        }
        if let Some(long) = a.strip_prefix("--") {
            inv.options.push(a.clone());
            if !long.contains('=') && !LONG_FLAGS.contains(&long) && i < args.len() {
                inv.options.push(args[i].clone());
                i += 1;
            }
        } else if let Some(short) = a.strip_prefix('-').filter(|s| !s.is_empty()) {
            inv.options.push(a.clone());
            let c = short.chars().next().expect("not empty");
            if short.len() == 1 && !SHORT_FLAGS.contains(c) && i < args.len() {
                inv.options.push(args[i].clone());
                i += 1;
            }
        } else {
            inv.script = Some(a.clone());
            inv.script_args = args[i..].to_vec();
            break;
        }
    }
    inv
}

/// One template as the API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    pub name: String,
    pub cpus: u32,
    pub memory_mib: u64,
    /// First-party (every account has it); false for the account's own,
    /// which a job gets only by naming it as its partition.
    pub global: bool,
}

impl Template {
    fn from_json(v: &Value) -> Option<Template> {
        Some(Template {
            name: v["name"].as_str()?.to_owned(),
            cpus: v["cpu"].as_u64()? as u32,
            memory_mib: v["memory_mb"].as_u64()?,
            // Published templates are another account's: named, never
            // chosen by fit.
            global: v["is_global"].as_bool().unwrap_or(true)
                && !v["published"].as_bool().unwrap_or(false),
        })
    }

    fn satisfies(&self, d: &Directives) -> bool {
        self.cpus >= d.cpus() && d.memory_mib().is_none_or(|m| self.memory_mib >= m)
    }
}

/// The template a job runs on, and a warning when it lacks what the job
/// asked for.
pub fn choose_template(
    d: &Directives,
    templates: &[Template],
    config: &Config,
) -> Result<(Template, Option<String>)> {
    let asked = || {
        let mut parts = vec![format!("{} CPU(s)", d.cpus())];
        if let Some(m) = d.memory_mib() {
            parts.push(format!("{m} MiB"));
        }
        parts.join(" and ")
    };
    let find = |name: &str| templates.iter().find(|t| t.name == name).cloned();
    let partitions = d.partitions();
    if !partitions.is_empty() {
        // As Slurm with `-p a,b`: the first partition that can take the job.
        let mut mapped = Vec::new();
        for p in &partitions {
            // Mapped by the configuration, else a template of that name
            // (one of the account's own, say).
            let Some(name) = config
                .partitions
                .get(*p)
                .map(String::as_str)
                .or_else(|| find(p).map(|_| *p))
            else {
                continue;
            };
            let t = find(name).with_context(|| {
                format!("partition {p} maps to template {name}, which this API does not have")
            })?;
            mapped.push(t);
        }
        if mapped.is_empty() {
            bail!(
                "invalid partition name specified: {} (map partitions to templates with \
                 SHOAL_PARTITIONS=name=template,... or \"partitions\" in the config file)",
                partitions.join(",")
            );
        }
        if let Some(t) = mapped.iter().find(|t| t.satisfies(d)) {
            return Ok((t.clone(), None));
        }
        let t = mapped.remove(0);
        let warning = format!(
            "the job asks for {} but template {} (partition {}) has {} vCPU(s) and {} MiB; \
             running there anyway",
            asked(),
            t.name,
            partitions[0],
            t.cpus,
            t.memory_mib
        );
        return Ok((t, Some(warning)));
    }
    let default = config.default_template();
    if let Some(t) = find(default).filter(|t| t.satisfies(d)) {
        return Ok((t, None));
    }
    // Without a partition a job runs on a first-party template, never on
    // an account's own that happens to fit.
    let mut fitting: Vec<&Template> = templates
        .iter()
        .filter(|t| t.global && t.satisfies(d))
        .collect();
    fitting.sort_by_key(|t| (t.cpus, t.memory_mib));
    if let Some(t) = fitting.first() {
        return Ok(((*t).clone(), None));
    }
    let t = find(default)
        .or_else(|| {
            templates
                .iter()
                .filter(|t| t.global)
                .max_by_key(|t| (t.cpus, t.memory_mib))
                .cloned()
        })
        .context("the API has no template ready")?;
    let warning = format!(
        "no template has {}; running on {} ({} vCPU(s), {} MiB)",
        asked(),
        t.name,
        t.cpus,
        t.memory_mib
    );
    Ok((t, Some(warning)))
}

/// Where the command runs and how it was submitted, from the submitting
/// machine.
pub struct Submitter {
    /// The submit directory (absolute).
    pub submit_dir: PathBuf,
    pub user: String,
    pub host: String,
    /// The submitting shell's environment (what `--export` chooses from).
    pub environment: Vec<(String, String)>,
}

impl Submitter {
    pub fn here() -> Result<Submitter> {
        let submit_dir = std::env::current_dir().context("reading the current directory")?;
        let user = ["USER", "LOGNAME"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
            .unwrap_or_else(|| "unknown".into());
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "localhost".into());
        // Variables whose name or value is not UTF-8 cannot travel in JSON.
        let environment = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        Ok(Submitter {
            submit_dir,
            user,
            host,
            environment,
        })
    }
}

/// The job's working directory: `--chdir` (relative to the submit
/// directory), else the submit directory.
pub fn work_dir(d: &Directives, submit_dir: &Path) -> PathBuf {
    match &d.chdir {
        Some(dir) => submit_dir.join(dir),
        None => submit_dir.to_path_buf(),
    }
}

/// The directories whose new and changed files come back: the submit
/// directory, and the working directory when it is outside it.
fn results_under(submit_dir: &Path, work: &Path) -> Result<Vec<String>> {
    let utf8 = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .with_context(|| format!("{} is not UTF-8", p.display()))
    };
    let mut dirs = vec![utf8(submit_dir)?];
    if !work.starts_with(submit_dir) {
        dirs.push(utf8(work)?);
    }
    Ok(dirs)
}

/// `after_ok` of the sweep: only `afterok` on whole jobs has a meaning in
/// the sweeps API; anything else is refused with the reason.
fn after_ok(d: &Directives) -> Result<Vec<String>> {
    let Some(dep) = &d.dependency else {
        return Ok(Vec::new());
    };
    if dep.any && dep.conditions.len() > 1 {
        bail!("--dependency with '?' (any of) is not supported on Shoal: only afterok:ID[:ID...]");
    }
    let mut ids = Vec::new();
    for c in &dep.conditions {
        if c.kind != DepKind::AfterOk {
            bail!(
                "--dependency={:?} is not supported on Shoal: only afterok:ID[:ID...] (the job \
                 starts when those jobs completed with every task exit code 0)",
                c.kind
            );
        }
        for j in &c.jobs {
            if j.task_id.is_some() {
                bail!("--dependency=afterok:{j}: Shoal waits for whole jobs only, not one task");
            }
            ids.push(j.job_id.to_string());
        }
    }
    Ok(ids)
}

/// Single-quotes a word for `sh`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The `POST /v1/sweeps` body of a parsed script.
#[cfg(test)]
pub fn sweep_request(
    script: &BatchScript,
    script_path: Option<&str>,
    script_args: &[String],
    template: &Template,
    who: &Submitter,
    config: &Config,
) -> Result<Value> {
    sweep_request_with(
        script,
        script_path,
        script_args,
        template,
        who,
        config,
        None,
    )
}

/// [`sweep_request`], with the job's prelude file (`--prelude`) if given.
pub fn sweep_request_with(
    script: &BatchScript,
    script_path: Option<&str>,
    script_args: &[String],
    template: &Template,
    who: &Submitter,
    config: &Config,
    prelude_file: Option<String>,
) -> Result<Value> {
    let split = super::prelude::split(&script.body, prelude_file, &who.submit_dir)?;
    let d = &script.directives;
    let name = d.job_name_or_default(script_path);
    let work = work_dir(d, &who.submit_dir);
    let work_s = work
        .to_str()
        .context("the working directory is not UTF-8")?;
    let timeout = match d.time {
        Some(TimeLimit::Unlimited) => UNLIMITED_TIME_SECONDS,
        Some(TimeLimit::Limit(_)) => d
            .time_limit()
            .map(|t| t.as_secs().clamp(1, UNLIMITED_TIME_SECONDS))
            .unwrap_or(DEFAULT_TIME_SECONDS),
        None => DEFAULT_TIME_SECONDS,
    };
    let cells: Vec<Value> = match &d.array {
        Some(a) => a.task_ids.iter().map(|t| json!(t)).collect(),
        None => vec![json!(0)],
    };
    let mut command = format!(
        "chmod 755 {SCRIPT_PATH} {SRUN_DIR}/srun && PATH={SRUN_DIR}:\"$PATH\" exec {SCRIPT_PATH}"
    );
    for a in script_args {
        command.push(' ');
        command.push_str(&shell_quote(a));
    }
    let mut body = json!({
        "name": name,
        "template": template.name,
        "command": command,
        "cells": cells,
        "workdir": work_s,
        "timeout_seconds": timeout,
        "retries": 0,
        "files": {
            SCRIPT_PATH: base64::engine::general_purpose::STANDARD.encode(&split.task_body),
            format!("{SRUN_DIR}/srun"): base64::engine::general_purpose::STANDARD.encode(SRUN),
        },
        // What a task writes or changes under the submit directory (and
        // the working directory, if elsewhere) comes back, as on a shared
        // filesystem.
        "results_under": results_under(&who.submit_dir, &work)?,
        "after_ok": after_ok(d)?,
        "env": shoal_slurm::exported_environment(d.export.as_deref(), who.environment.clone())?,
        "slurm": {
            "job_name": name,
            "array": d.array.as_ref().map(|a| a.to_slurm_string()),
            "user": who.user,
            "submit_dir": who.submit_dir.to_str(),
            "submit_host": who.host,
            "work_dir": work_s,
            "output": d.output,
            "error": d.error,
            "open_mode": if d.open_append { "append" } else { "truncate" },
            "partition": d.partitions().first(),
            "account": d.account,
            "cpus_per_task": d.cpus_per_task,
            "mem_mib": d.mem_mib.filter(|m| *m > 0),
            "mem_per_cpu_mib": d.mem_per_cpu_mib,
            "requeue": d.requeue.unwrap_or(true),
            "time_limit_seconds": timeout,
            // At the limit: SIGTERM, then SIGKILL after KillWait; --signal before.
            "kill_wait_seconds": KILL_WAIT_SECONDS,
            "signal": d.signal.map(|w| json!({"signal": w.signal, "before_seconds": w.before_seconds})),
            "cluster_name": config.cluster_name(),
            // A task's VM: the template's size, or fewer CPUs where the
            // job asked for fewer (the runner sizes it the same way).
            "vcpus": d.cpus_per_task.map_or(template.cpus, |c| c.clamp(1, template.cpus)),
        },
    });
    if let Some(throttle) = d.array.as_ref().and_then(|a| a.throttle) {
        body["throttle"] = json!(throttle);
    }
    if d.hold {
        body["hold"] = json!(true);
    }
    if let Some(prelude) = &split.prelude {
        // Run by the script's own interpreter, in the working directory,
        // once; every task forks from the sandbox it leaves.
        let interpreter = script.shebang.as_deref().unwrap_or("/bin/sh");
        body["files"][super::prelude::PRELUDE_PATH] =
            json!(base64::engine::general_purpose::STANDARD.encode(prelude));
        body["fork_from"] = json!({
            "setup": format!("{interpreter} {}", super::prelude::PRELUDE_PATH),
            "timeout_seconds": timeout,
        });
    }
    if let Some(begin) = &d.begin {
        let at = shoal_slurm::parse_begin(begin, chrono::Local::now())?;
        body["begin_at"] = json!(at.timestamp());
    }
    Ok(body)
}

/// `--keep-failed` without a time: two hours.
const DEFAULT_KEEP_FAILED_SECONDS: u64 = 2 * 3600;

/// `--keep-failed=TIME`: `90s`, `30m`, `2h`, `1d`, or a Slurm time
/// (`2:00:00`, `120` minutes); empty: two hours.
pub fn parse_keep_failed(value: &str) -> Result<u64> {
    let v = value.trim();
    if v.is_empty() {
        return Ok(DEFAULT_KEEP_FAILED_SECONDS);
    }
    let unit = |suffix: char, seconds: u64| {
        v.strip_suffix(suffix)
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| n * seconds)
    };
    let seconds = unit('s', 1)
        .or_else(|| unit('m', 60))
        .or_else(|| unit('h', 3600))
        .or_else(|| unit('d', 86400))
        .or_else(|| {
            shoal_slurm::parse_time_limit(v)
                .ok()
                .flatten()
                .map(|d| d.as_secs())
        })
        .with_context(|| format!("--keep-failed={v}: a time such as 2h, 30m, 1d or 2:00:00"))?;
    if seconds == 0 || seconds > 7 * 86400 {
        bail!("--keep-failed={v}: from a second to a week");
    }
    Ok(seconds)
}

/// Bytes as sbatch users read them.
fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / (1u64 << 10) as f64),
        b => format!("{b} B"),
    }
}

/// What `--test-only` prints instead of submitting, in sbatch's words
/// (no job id: none was taken).
fn test_only_line(body: &Value, template: &Template) -> String {
    let tasks = body["cells"].as_array().map_or(1, Vec::len);
    format!(
        "sbatch: Job to start at {} using {} processors on nodes {} in partition {} ({} task{}, \
         {} MiB each, time limit {} s); nothing was submitted",
        chrono::Local::now().format("%Y-%m-%dT%H:%M:%S"),
        body["slurm"]["vcpus"],
        template.name,
        body["slurm"]["partition"]
            .as_str()
            .unwrap_or(&template.name),
        tasks,
        if tasks == 1 { "" } else { "s" },
        body["slurm"]["mem_mib"]
            .as_u64()
            .map_or(template.memory_mib, |m| m.min(template.memory_mib)),
        body["timeout_seconds"],
    )
}

/// Parses and checks a script with its command-line options; refusals and
/// bad values are errors before anything is created.
pub fn read_script(text: &str, options: &[String]) -> Result<BatchScript> {
    if !text.starts_with("#!") {
        bail!(
            "This does not look like a batch script. The first line must start with #! \
             followed by the path to an interpreter."
        );
    }
    let args: Vec<&str> = options.iter().map(String::as_str).collect();
    shoal_slurm::parse_script_with_args(text, &args).map_err(|e| match e {
        SlurmError::Refused(_) => anyhow::anyhow!("{e}"),
        other => anyhow::Error::new(other),
    })
}

/// `shoal sbatch`: submits, prints the job id, and either follows the job
/// in the foreground (`--wait`) or leaves a background follower to write
/// the output files. Returns the process's exit code.
pub async fn sbatch(args: &[String]) -> Result<std::process::ExitCode> {
    let inv = split_args(args);
    let text = match (&inv.wrap, &inv.script) {
        (Some(_), Some(_)) => bail!("Script arguments not permitted with --wrap option"),
        // What sbatch itself writes for --wrap.
        (Some(cmd), None) => {
            format!("#!/bin/sh\n# This script was created by sbatch --wrap.\n\n{cmd}\n")
        }
        (None, Some(path)) => {
            std::fs::read_to_string(path).with_context(|| format!("Unable to open file {path}"))?
        }
        (None, None) => {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("reading the script from standard input")?;
            s
        }
    };
    let script = read_script(&text, &inv.options)?;
    for w in &script.warnings {
        eprintln!("sbatch: warning: {w}");
    }
    for (line, text) in &script.module_lines {
        eprintln!(
            "sbatch: line {line}: skipped `{}`: the template carries the software",
            text.trim()
        );
    }
    let config = Config::load()?;
    let api = Api::new(&config)?;
    let templates: Vec<Template> = api
        .templates()
        .await?
        .iter()
        .filter_map(Template::from_json)
        .collect();
    let (template, warning) = choose_template(&script.directives, &templates, &config)?;
    if let Some(w) = warning {
        eprintln!("sbatch: warning: {w}");
    }
    let who = Submitter::here()?;
    let script_name = if inv.wrap.is_some() {
        Some("wrap")
    } else {
        inv.script.as_deref()
    };
    let words = super::inputs::shoal_words(&text);
    let keep_failed = inv
        .keep_failed
        .clone()
        .or_else(|| super::inputs::option_values(&words, "keep-failed").pop());
    let prelude_file = inv
        .prelude
        .as_deref()
        .map(|f| std::fs::read_to_string(f).with_context(|| format!("--prelude {f}")))
        .transpose()?;
    let body = sweep_request_with(
        &script,
        script_name,
        &inv.script_args,
        &template,
        &who,
        &config,
        prelude_file,
    )?;
    let mut extra_inputs = super::inputs::directive_inputs(&text);
    extra_inputs.extend(inv.inputs.iter().cloned());
    let inputs = super::inputs::gather(&who.submit_dir, &extra_inputs)?;
    let mut body = body;
    if let Some(keep) = &keep_failed {
        body["slurm"]["keep_failed_seconds"] = json!(parse_keep_failed(keep)?);
    }
    if inv.test_only {
        eprintln!("{}", test_only_line(&body, &template));
        eprintln!(
            "sbatch: the tasks would see {} input file(s), {} in all, at their paths here",
            inputs.len(),
            human_bytes(inputs.iter().map(|i| i.size).sum())
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let sent = super::inputs::send(&api, &inputs)
        .await
        .context("Batch job submission failed: sending the inputs")?;
    if sent.files > 0 {
        eprintln!(
            "sbatch: sent {} input file(s), {} ({} unchanged since an earlier job)",
            sent.files,
            human_bytes(sent.bytes),
            sent.unchanged
        );
    }
    body["inputs"] = Value::Array(sent.inputs);
    let sweep = api
        .create_sweep(&body)
        .await
        .context("Batch job submission failed")?;
    let job_id = sweep["job_id"].as_u64().context("the API gave no job id")?;
    if script.directives.parsable {
        println!("{job_id}");
    } else {
        println!("{}", shoal_slurm::format_submitted(job_id));
    }
    use std::io::Write;
    std::io::stdout().flush()?;
    if inv.wait {
        let outcome = super::follow::follow(&api, &job_id.to_string(), true).await?;
        return Ok(std::process::ExitCode::from(outcome.exit_code()));
    }
    super::follow::spawn_background(job_id)?;
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// User `a` on host `h`, in `/home/a/run`, with this shell environment.
    fn submitter(environment: &[(&str, &str)]) -> Submitter {
        Submitter {
            submit_dir: "/home/a/run".into(),
            user: "a".into(),
            host: "h".into(),
            environment: environment
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    /// `srun` as a task runs it: from its directory, under POSIX `sh`.
    fn srun(args: &[&str]) -> (i32, String, String) {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let shim = bin.join("srun");
        std::fs::write(&shim, SRUN).unwrap();
        let out = std::process::Command::new("sh")
            .arg(&shim)
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn wrap_and_test_only_are_the_cli_s_own() {
        let inv = split_args(&strings(&[
            "--test-only",
            "-c",
            "2",
            "--wrap",
            "python3 -V",
        ]));
        assert!(inv.test_only);
        assert_eq!(inv.wrap.as_deref(), Some("python3 -V"));
        assert_eq!(inv.options, strings(&["-c", "2"]));
        assert_eq!(inv.script, None);
        let inv = split_args(&strings(&["--wrap=hostname", "--export=NONE"]));
        assert_eq!(inv.wrap.as_deref(), Some("hostname"));
        assert_eq!(inv.options, strings(&["--export=NONE"]));
    }

    #[test]
    fn export_chooses_the_tasks_variables() {
        let who = submitter(&[
            ("MY_PARAM", "7"),
            ("OTHER", "x"),
            ("PATH", "/home/a/bin:/usr/bin"),
        ]);
        let t = &templates()[0];
        let env = |options: &[&str]| {
            let script = read_script("#!/bin/sh\necho\n", &strings(options)).unwrap();
            sweep_request(&script, None, &[], t, &who, &Config::default()).unwrap()["env"].clone()
        };
        assert_eq!(env(&[]), json!({"MY_PARAM": "7", "OTHER": "x"}));
        assert_eq!(env(&["--export=NONE"]), json!({}));
        assert_eq!(
            env(&["--export=MY_PARAM,SEED=3"]),
            json!({"MY_PARAM": "7", "SEED": "3"})
        );
        let bad = read_script("#!/bin/sh\n#SBATCH --export=1X=2\necho\n", &[]).unwrap_err();
        assert!(
            format!("{bad:#}").contains("not a variable name"),
            "{bad:#}"
        );
    }

    #[test]
    fn srun_runs_one_step_here_and_refuses_more_with_the_reason() {
        assert_eq!(srun(&["echo", "hi"]), (0, "hi\n".into(), String::new()));
        let (code, out, _) = srun(&[
            "-n1",
            "--cpus-per-task=2",
            "-J",
            "step",
            "--mem=1G",
            "-u",
            "sh",
            "-c",
            "echo $SLURM_CPUS_PER_TASK $SLURM_JOB_NAME $SLURM_STEP_ID $SLURM_NTASKS $SLURM_PROCID",
        ]);
        assert_eq!((code, out.as_str()), (0, "2 step 0 1 0\n"));
        // The exit status is the command's, labelled or not.
        assert_eq!(srun(&["sh", "-c", "exit 3"]).0, 3);
        let (code, out, _) = srun(&["-l", "sh", "-c", "echo a; echo b; exit 5"]);
        assert_eq!((code, out.as_str()), (5, "0: a\n0: b\n"));
        assert_eq!(srun(&["-D", "/", "pwd"]).1, "/\n");
        for (args, why) in [
            (&["-n", "4", "true"][..], "a step of 4 tasks"),
            (&["--ntasks=2", "true"][..], "a step of 2 tasks"),
            (&["-N2", "true"][..], "a step of 2 nodes"),
            (&["--mpi=pmix", "./solver"][..], "MPI"),
            (&["-n"][..], "-n needs a value"),
            (
                &["--frobnicate", "x"][..],
                "unrecognized option '--frobnicate'",
            ),
            (&[][..], "no command given"),
        ] {
            let (code, out, err) = srun(args);
            assert_eq!((code, out.as_str()), (1, ""), "{args:?}: {err}");
            assert!(
                err.starts_with("srun: error: ") && err.contains(why),
                "{args:?}: {err}"
            );
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn splits_options_script_and_its_arguments() {
        let inv = split_args(&strings(&[
            "-t",
            "10",
            "--array=1-3",
            "--requeue",
            "-J",
            "x",
            "--wait",
            "job.sh",
            "-a",
            "b",
        ]));
        assert_eq!(
            inv.options,
            strings(&["-t", "10", "--array=1-3", "--requeue", "-J", "x"])
        );
        assert!(inv.wait);
        assert_eq!(inv.script.as_deref(), Some("job.sh"));
        assert_eq!(inv.script_args, strings(&["-a", "b"]));
        let inv = split_args(&strings(&["--partition", "short", "-t10"]));
        assert_eq!(inv.script, None);
        assert_eq!(inv.options, strings(&["--partition", "short", "-t10"]));
    }

    fn templates() -> Vec<Template> {
        vec![
            Template {
                name: "code-interpreter".into(),
                cpus: 1,
                memory_mib: 512,
                global: true,
            },
            Template {
                name: "big".into(),
                cpus: 4,
                memory_mib: 4096,
                global: true,
            },
            Template {
                name: "mid".into(),
                cpus: 2,
                memory_mib: 2048,
                global: true,
            },
            Template {
                name: "my-tools".into(),
                cpus: 8,
                memory_mib: 8192,
                global: false,
            },
        ]
    }

    #[test]
    fn an_accounts_template_is_chosen_only_by_naming_it() {
        let config = Config::default();
        let (t, w) =
            choose_template(&directives(&["-p", "my-tools"]), &templates(), &config).unwrap();
        assert_eq!((t.name.as_str(), w), ("my-tools", None));
        // It fits -c 8, but no job lands there without asking.
        let (t, w) = choose_template(&directives(&["-c", "8"]), &templates(), &config).unwrap();
        assert_eq!(t.name, "code-interpreter");
        assert!(w.is_some());
        let (t, _) = choose_template(&directives(&["-c", "3"]), &templates(), &config).unwrap();
        assert_eq!(t.name, "big");
    }

    fn directives(args: &[&str]) -> Directives {
        shoal_slurm::parse_script_with_args("#!/bin/sh\ntrue\n", args)
            .unwrap()
            .directives
    }

    #[test]
    fn template_follows_the_request_and_the_partition_map() {
        let config = Config::default();
        let (t, w) = choose_template(&directives(&[]), &templates(), &config).unwrap();
        assert_eq!((t.name.as_str(), w), ("code-interpreter", None));
        let (t, w) = choose_template(&directives(&["-c", "2"]), &templates(), &config).unwrap();
        assert_eq!((t.name.as_str(), w), ("mid", None));
        let (t, w) = choose_template(&directives(&["--mem=3G"]), &templates(), &config).unwrap();
        assert_eq!((t.name.as_str(), w), ("big", None));
        let (t, w) = choose_template(&directives(&["--mem=64G"]), &templates(), &config).unwrap();
        assert_eq!(t.name, "code-interpreter");
        assert!(w.unwrap().contains("65536 MiB"));

        let mut config = Config::default();
        config.partitions.insert("short".into(), "mid".into());
        let (t, w) = choose_template(&directives(&["-p", "short"]), &templates(), &config).unwrap();
        assert_eq!((t.name.as_str(), w), ("mid", None));
        let (t, w) = choose_template(
            &directives(&["-p", "short", "-c", "4"]),
            &templates(),
            &config,
        )
        .unwrap();
        assert_eq!(t.name, "mid");
        assert!(w.unwrap().contains("partition short"));
        let e = choose_template(&directives(&["-p", "gpu"]), &templates(), &config).unwrap_err();
        assert!(e
            .to_string()
            .contains("invalid partition name specified: gpu"));
    }

    #[test]
    fn request_carries_the_array_time_and_dependency() {
        let script = read_script(
            "#!/bin/bash\n#SBATCH --array=1-6%3\n#SBATCH -t 1:30\n#SBATCH -J x\necho hi\n",
            &strings(&["--dependency=afterok:1000"]),
        )
        .unwrap();
        let who = submitter(&[("MY_PARAM", "7"), ("HOME", "/home/a")]);
        let t = &templates()[0];
        let body =
            sweep_request(&script, Some("job.sh"), &[], t, &who, &Config::default()).unwrap();
        assert_eq!(body["cells"], json!([1, 2, 3, 4, 5, 6]));
        assert_eq!(body["throttle"], 3);
        assert_eq!(body["timeout_seconds"], 120, "1:30 rounds up to 2 minutes");
        assert_eq!(body["after_ok"], json!(["1000"]));
        assert_eq!(body["name"], "x");
        assert_eq!(body["workdir"], "/home/a/run");
        assert_eq!(body["slurm"]["array"], "1-6%3");
        // --export's default, ALL: the shell's variables but the machine's.
        assert_eq!(body["env"], json!({"MY_PARAM": "7"}));

        let single = read_script("#!/bin/sh\necho\n", &[]).unwrap();
        let body = sweep_request(
            &single,
            Some("a/b.sh"),
            &strings(&["it's"]),
            t,
            &who,
            &Config::default(),
        )
        .unwrap();
        assert_eq!(body["cells"], json!([0]));
        assert_eq!(body["slurm"]["array"], Value::Null);
        assert_eq!(body["name"], "b.sh");
        assert!(body["command"].as_str().unwrap().ends_with(r"'it'\''s'"));
        assert!(body.get("throttle").is_none());
    }

    #[test]
    fn unsupported_dependencies_and_non_scripts_are_refused() {
        let e = read_script("echo hi\n", &[]).unwrap_err();
        assert!(e.to_string().contains("#!"));
        let s = read_script("#!/bin/sh\n#SBATCH -d afterany:5\ntrue\n", &[]).unwrap();
        assert!(after_ok(&s.directives)
            .unwrap_err()
            .to_string()
            .contains("only afterok"));
        let e = read_script("#!/bin/sh\n#SBATCH --nodes=2\ntrue\n", &[]).unwrap_err();
        assert!(e.to_string().contains("cannot run on Shoal"), "{e}");
    }
}
