//! The Slurm bridge's commands: `shoal sbatch`, `squeue`, `sacct`,
//! `scancel` and `sync`, over the sweeps API (docs/SLURM.md).
//!
//! Owns: their command-line arguments and dispatch. What they do is in
//! `sbatch.rs` (submission), `follow.rs` (output files on this machine),
//! `views.rs` (queue, accounting, cancel); the API client and settings in
//! `api.rs` and `config.rs`. Everything Slurm-specific that needs no I/O
//! is `shoal_slurm`'s.
//!
//! May not: run VMs or open the database; these commands are API clients.

pub mod api;
pub mod config;
pub mod debug;
pub mod follow;
pub mod info;
pub mod inputs;
pub mod prelude;
pub mod sbatch;
pub mod views;

use anyhow::Result;
use clap::Args;
use std::process::ExitCode;

/// `shoal sbatch [options] [script [args...]]`.
#[derive(Args)]
pub struct SbatchArgs {
    /// sbatch's own options, the script and its arguments, as sbatch takes
    /// them (options on the command line override `#SBATCH` lines).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<String>,
}

#[derive(Args)]
#[command(disable_help_flag = true)]
pub struct SqueueArgs {
    /// Only these jobs or array tasks (comma-separated: ID, ID_TASK).
    #[arg(short = 'j', long = "jobs", value_delimiter = ',')]
    pub jobs: Vec<String>,
    /// Only jobs submitted as this user.
    #[arg(short = 'u', long = "user")]
    pub user: Option<String>,
    /// Only your jobs (every job of the token is yours).
    #[arg(long = "me")]
    pub me: bool,
    /// Only jobs in these states (comma-separated: PD,R or PENDING,RUNNING; all).
    #[arg(short = 't', long = "states")]
    pub states: Option<String>,
    /// No header line (squeue's -h; --help is help).
    #[arg(short = 'h', long = "noheader")]
    pub noheader: bool,
    /// One line per array task, pending ones included (squeue's -r).
    #[arg(short = 'r', long = "array")]
    pub array: bool,
    /// Columns as squeue's -o: `%[.][width]X` fields (%i %j %u %P %t %T %M %l %D %C %N %r %R %A %F %K %a %V %S %e).
    #[arg(short = 'o', long = "format")]
    pub format: Option<String>,
    /// Columns as squeue's -O: `Name[:[.]width],...` (JobID, Name, UserName, State, StateCompact, Reason, ReasonList, TimeUsed, TimeLimit, NumCPUs, NodeList, ...).
    #[arg(short = 'O', long = "Format")]
    pub long_format: Option<String>,
    /// Print help.
    #[arg(long = "help", action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

#[derive(Args)]
pub struct SacctArgs {
    /// Job ids: ID, ID_TASK, comma-separated.
    #[arg(short = 'j', long = "jobs")]
    pub jobs: Vec<String>,
    /// Fields, comma-separated, each optionally `%WIDTH`.
    #[arg(short = 'o', long = "format")]
    pub format: Option<String>,
    /// `|` after every field.
    #[arg(short = 'p', long = "parsable")]
    pub parsable: bool,
    /// `|` between fields.
    #[arg(short = 'P', long = "parsable2")]
    pub parsable2: bool,
    /// No header.
    #[arg(short = 'n', long = "noheader")]
    pub noheader: bool,
    /// Accepted for compatibility: Shoal has no job steps, so every line is
    /// an allocation.
    #[arg(short = 'X', long = "allocations")]
    pub allocations: bool,
    /// Jobs that ran or waited at or after this time (YYYY-MM-DD[THH:MM[:SS]],
    /// HH:MM[:SS] today, now[-N{seconds|minutes|hours|days|weeks}], today,
    /// midnight, noon). Default without -j: 00:00 today, as sacct.
    #[arg(short = 'S', long = "starttime")]
    pub starttime: Option<String>,
    /// Jobs that started (or were submitted) at or before this time; the same forms.
    #[arg(short = 'E', long = "endtime")]
    pub endtime: Option<String>,
    /// Only these states (comma-separated: CD,F or COMPLETED,FAILED).
    #[arg(short = 's', long = "state")]
    pub state: Option<String>,
    /// Only jobs of these names (comma-separated).
    #[arg(long = "name")]
    pub name: Option<String>,
    /// The long field list (as far as Shoal measures it).
    #[arg(short = 'l', long = "long")]
    pub long: bool,
}

#[derive(Args)]
pub struct ScancelArgs {
    /// ID, ID_TASK or ID_[TASKS]; none: the jobs the filters choose.
    #[arg(required_unless_present_any = ["user", "name", "state"])]
    pub jobs: Vec<String>,
    /// Without ids: the queued jobs of this user.
    #[arg(short = 'u', long = "user")]
    pub user: Option<String>,
    /// Without ids: the queued jobs of this name.
    #[arg(short = 'n', long = "name", alias = "jobname")]
    pub name: Option<String>,
    /// Without ids: only tasks in these states (PENDING, RUNNING; PD, R).
    #[arg(short = 't', long = "state")]
    pub state: Option<String>,
    /// Send this signal (USR1, SIGTERM, 10) to the running tasks instead
    /// of cancelling them.
    #[arg(short = 's', long = "signal")]
    pub signal: Option<String>,
}

/// `shoal scontrol COMMAND ...`, in scontrol's words.
#[derive(Args)]
pub struct ScontrolArgs {
    /// `show job ID`, `requeue ID`, `update JobId=ID ArrayTaskThrottle=N`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub words: Vec<String>,
}

/// `shoal debug JOBID_TASK [-- CMD...]`.
#[derive(Args)]
pub struct DebugArgs {
    /// The failed task whose kept sandbox to enter (`1000_14`).
    pub task: String,
    /// A command to run there instead of an interactive shell.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// `shoal seff JOBID[_TASK]`.
#[derive(Args)]
pub struct SeffArgs {
    /// A job (every task) or one array task.
    pub job: String,
}

/// `shoal sinfo`.
#[derive(Args)]
#[command(disable_help_flag = true)]
pub struct SinfoArgs {
    /// One line per host and partition, with CPUs and memory.
    #[arg(short = 'N', long = "Node")]
    pub nodes: bool,
    /// No header line.
    #[arg(short = 'h', long = "noheader")]
    pub noheader: bool,
    /// Print help.
    #[arg(long = "help", action = clap::ArgAction::Help)]
    pub help: Option<bool>,
}

#[derive(Args)]
pub struct SyncArgs {
    /// Job ids whose finished tasks' files to write.
    #[arg(required = true)]
    pub jobs: Vec<String>,
    /// Keep writing as tasks finish, until the job is over.
    #[arg(long)]
    pub follow: bool,
    /// Say nothing (the background follower).
    #[arg(long)]
    pub quiet: bool,
}

fn api() -> Result<api::Api> {
    api::Api::new(&config::Config::load()?)
}

pub async fn debug(args: DebugArgs) -> Result<ExitCode> {
    let code = debug::debug(&args.task, &args.command).await?;
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// `shoal shell ID`.
#[derive(Args)]
pub struct ShellArgs {
    /// The sandbox to open a terminal in.
    pub sandbox: String,
}

pub async fn shell(args: ShellArgs) -> Result<ExitCode> {
    let code = debug::shell(&args.sandbox).await?;
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

pub async fn seff(args: SeffArgs) -> Result<ExitCode> {
    let config = config::Config::load()?;
    let api = api::Api::new(&config)?;
    info::seff(&api, &args.job, config.cluster_name()).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn sinfo(args: SinfoArgs) -> Result<ExitCode> {
    let config = config::Config::load()?;
    let api = api::Api::new(&config)?;
    info::sinfo(&api, args.nodes, args.noheader, config.default_template()).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn sbatch(args: SbatchArgs) -> Result<ExitCode> {
    sbatch::sbatch(&args.args).await
}

pub async fn squeue(args: SqueueArgs) -> Result<ExitCode> {
    let mut jobs = Vec::new();
    for j in &args.jobs {
        jobs.extend(shoal_slurm::parse_job_refs(j)?);
    }
    let states = args
        .states
        .as_deref()
        .map(shoal_slurm::parse_states)
        .transpose()?;
    let columns = match (&args.format, &args.long_format) {
        (Some(f), _) => Some(shoal_slurm::squeue_format::parse_format(f)?),
        (None, Some(f)) => Some(shoal_slurm::squeue_format::parse_long_format(f)?),
        (None, None) => None,
    };
    let query = views::SqueueQuery {
        jobs,
        user: args.user,
        states,
        noheader: args.noheader,
        one_per_task: args.array,
        columns,
    };
    views::squeue(&api()?, &query).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn sacct(args: SacctArgs) -> Result<ExitCode> {
    let a = views::SacctArgs {
        jobs: args.jobs,
        format: args.format,
        parsable: args.parsable,
        parsable2: args.parsable2,
        noheader: args.noheader,
        starttime: args.starttime,
        endtime: args.endtime,
        state: args.state,
        name: args.name,
        long: args.long,
    };
    views::sacct(&api()?, &a).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn scontrol(args: ScontrolArgs) -> Result<ExitCode> {
    views::scontrol(&api()?, &args.words).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn scancel(args: ScancelArgs) -> Result<ExitCode> {
    if let Some(signal) = &args.signal {
        let filter = views::ScancelFilter {
            user: args.user.clone(),
            name: args.name.clone(),
            states: None,
        };
        views::signal_tasks(&api()?, &args.jobs, &filter, signal).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.jobs.is_empty() {
        let filter = views::ScancelFilter {
            user: args.user,
            name: args.name,
            states: args
                .state
                .as_deref()
                .map(shoal_slurm::parse_states)
                .transpose()?,
        };
        views::scancel_matching(&api()?, &filter).await?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.user.is_some() || args.name.is_some() || args.state.is_some() {
        anyhow::bail!(
            "scancel: error: -u, -n and -t choose jobs when no job id is given; name the jobs or the filters, not both"
        );
    }
    views::scancel(&api()?, &args.jobs).await?;
    Ok(ExitCode::SUCCESS)
}

pub async fn sync(args: SyncArgs) -> Result<ExitCode> {
    let api = api()?;
    if args.follow {
        for id in &args.jobs {
            follow::follow(&api, id, !args.quiet).await?;
        }
    } else {
        follow::sync(&api, &args.jobs).await?;
    }
    Ok(ExitCode::SUCCESS)
}
