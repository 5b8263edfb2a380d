//! The `shoal` command: every host-side role in one binary.
//!
//! Owns argument parsing and turning results into output and exit codes.
//! Holds no logic of its own: templates and VMs are the engine's, benches
//! live in `bench.rs` and only call the engine's public API.

mod admin;
mod bench;
mod bench_exec;
mod bench_fleet;
mod bench_slurm;
mod bench_sweep;
mod bench_template;
mod config;
mod fleet;
mod notify;
mod slurm;
mod templates;
mod tree;
mod up;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use shoal_engine::{Accel, Engine, EngineConfig};
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "shoal", version, about = "An on-demand microVM fleet")]
struct Cli {
    /// The configuration file (TOML; default /etc/shoal/shoal.toml when it
    /// exists): flags' long names as keys, at the top or in a command's
    /// table, and [tiers.NAME] and [rates]. A flag and its SHOAL_*
    /// variable win over it.
    #[arg(long, global = true, env = "SHOAL_CONFIG")]
    config: Option<PathBuf>,
    /// How log lines are written to stderr: text, or json (one object per
    /// line, for a log shipper).
    #[arg(long, global = true, env = "SHOAL_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Which log lines are written: a level (error, warn, info, debug,
    /// trace) or a filter (`shoal_engine=debug,info`); RUST_LOG wins over
    /// it. Default: info for the services (up, server, agent), warn for
    /// every other command.
    #[arg(long, global = true, env = "SHOAL_LOG")]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

impl Cli {
    /// Logs to stderr as asked; a request log line (`request`) per API
    /// request at info.
    fn init_logging(&self) {
        let service = matches!(
            self.command,
            Command::Up(_) | Command::Server(_) | Command::Agent(_)
        );
        let default = self
            .log
            .clone()
            .unwrap_or_else(|| if service { "info" } else { "warn" }.to_owned());
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .or_else(|_| tracing_subscriber::EnvFilter::try_new(&default))
            .unwrap_or_else(|e| {
                eprintln!("warning: --log {default:?}: {e}; logging at warn");
                tracing_subscriber::EnvFilter::new("warn")
            });
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
    }
}

#[derive(Args, Clone)]
pub(crate) struct EngineArgs {
    /// Where templates, snapshots and VM state live.
    #[arg(long, env = "SHOAL_STATE_DIR", default_value = "/var/lib/shoal")]
    pub(crate) state_dir: PathBuf,
    /// Force an accelerator (kvm or tcg); by default KVM where the host can
    /// run it, TCG otherwise.
    #[arg(long, env = "SHOAL_ACCEL")]
    accel: Option<Accel>,
    /// The QEMU binary.
    #[arg(long, env = "SHOAL_QEMU", default_value = "qemu-system-x86_64")]
    qemu: PathBuf,
    /// Where images and baked templates are cached (default: the state dir).
    #[arg(long, env = "SHOAL_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Network namespaces kept prepared, so a create or a fork child does
    /// not wait for one to be made.
    #[arg(long, env = "SHOAL_NET_POOL_SIZE")]
    net_pool_size: Option<usize>,
    /// Each QEMU runs as uid = gid = this plus its network slot's index
    /// (0-16383): a range no account on the host may use.
    #[arg(long, env = "SHOAL_VM_UID_BASE", default_value_t = shoal_engine::jail::DEFAULT_UID_BASE)]
    vm_uid_base: u32,
    /// Memory a VM's cgroup may hold beyond its guest RAM (QEMU itself, its
    /// translation cache, page cache).
    #[arg(long, env = "SHOAL_VM_MEMORY_OVERHEAD_MIB", default_value_t = 256)]
    vm_memory_overhead_mib: u32,
    /// One memory limit for every VM's cgroup instead of its guest RAM plus
    /// the overhead (a host that wants a hard cap per VM; tests use a small
    /// one to provoke an out-of-memory kill).
    #[arg(long, env = "SHOAL_VM_MEMORY_LIMIT_MIB")]
    vm_memory_limit_mib: Option<u32>,
}

impl EngineArgs {
    fn config(&self) -> EngineConfig {
        let mut config = EngineConfig::new(&self.state_dir);
        config.accel = self.accel;
        config.qemu = self.qemu.clone();
        if let Some(cache) = &self.cache_dir {
            config.cache_dir = cache.clone();
        }
        if let Some(size) = self.net_pool_size {
            config.net_pool_size = size;
        }
        config.jail.uid_base = self.vm_uid_base;
        config.jail.memory_overhead_mib = self.vm_memory_overhead_mib;
        config.jail.memory_limit_mib = self.vm_memory_limit_mib;
        config
    }

    async fn open(&self) -> Result<Engine> {
        Engine::open(self.config())
            .await
            .with_context(|| format!("opening the engine on {}", self.state_dir.display()))
    }
}

#[derive(Subcommand)]
enum Command {
    /// Build and bake templates.
    Template {
        #[command(subcommand)]
        command: TemplateCommand,
    },
    /// Create a sandbox, run one command in it, print its output, kill it.
    Run {
        #[command(flatten)]
        engine: EngineArgs,
        #[arg(long, default_value = "code-interpreter")]
        template: String,
        /// Seconds before the command is killed.
        #[arg(long)]
        timeout: Option<u64>,
        /// The shell command to run.
        command: String,
    },
    /// Create sandboxes and hold them until killed (for crash tests).
    #[command(hide = true)]
    Hold {
        #[command(flatten)]
        engine: EngineArgs,
        #[arg(long, default_value = "code-interpreter")]
        template: String,
        #[arg(long, default_value_t = 1)]
        count: usize,
        /// Also fork the first sandbox into this many children.
        #[arg(long, default_value_t = 0)]
        fork: usize,
    },
    /// Run one host: the HTTP API, the host agent and the database.
    Up(up::UpArgs),
    /// Run a fleet's front: placement and routing over the agents (PostgreSQL).
    Server(fleet::ServerArgs),
    /// Run one host of a fleet, reporting to a front.
    Agent(fleet::AgentArgs),
    /// A fleet's hosts: join tokens and revocation.
    Host {
        #[command(subcommand)]
        command: HostCommand,
    },
    /// API tokens.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Accounts (an operator's command: it writes the database).
    Account {
        #[command(subcommand)]
        command: AccountCommand,
    },
    /// Every account's sandboxes (an operator's command).
    Sandbox {
        #[command(subcommand)]
        command: SandboxCommand,
    },
    /// Every account's snapshots (an operator's command).
    Snapshot {
        #[command(subcommand)]
        command: SnapshotCommand,
    },
    /// Submit a Slurm batch script as a job on the fleet (docs/SLURM.md).
    Sbatch(slurm::SbatchArgs),
    /// Pending and running jobs, as Slurm's squeue.
    Squeue(slurm::SqueueArgs),
    /// Accounting of jobs: state, exit code, elapsed, CPU time, cost.
    Sacct(slurm::SacctArgs),
    /// Cancel jobs or array tasks: ID, ID_TASK, ID_[TASKS].
    Scancel(slurm::ScancelArgs),
    /// scontrol: `show job ID`, `requeue ID`, `update JobId=ID ArrayTaskThrottle=N`.
    Scontrol(slurm::ScontrolArgs),
    /// A shell (or `-- CMD`) in the sandbox a failed task left behind
    /// (`sbatch --keep-failed`).
    Debug(slurm::DebugArgs),
    /// An interactive terminal in a running sandbox (over the API's
    /// WebSocket terminal; exits with the shell's code).
    Shell(slurm::ShellArgs),
    /// How well a job used the CPUs and memory it asked for, and the cost.
    Seff(slurm::SeffArgs),
    /// The fleet's partitions (templates) and hosts, as Slurm's sinfo.
    Sinfo(slurm::SinfoArgs),
    /// Write finished tasks' output files here (sbatch's follower does it
    /// in the background).
    Sync(slurm::SyncArgs),
    /// The settings a command would run with, and where each comes from
    /// (flag, SHOAL_* variable, configuration file or default).
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Print a shell's completion script (bash, zsh, fish, elvish,
    /// powershell): `shoal completions bash > /etc/bash_completion.d/shoal`.
    Completions { shell: clap_complete::Shell },
    /// Write the manual pages (shoal.1 and one per command) into DIR.
    Man { dir: PathBuf },
    /// Measure the engine and write a JSON report.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Subcommand)]
enum TemplateCommand {
    /// With -f: build NAME from a Dockerfile on the API's fleet (SHOAL_API,
    /// SHOAL_API_KEY), following its log. Without: bake first-party
    /// templates on this host (image, boot, snapshot), or reuse their bakes.
    Build {
        #[command(flatten)]
        engine: EngineArgs,
        /// With -f, the one template to build; without, first-party
        /// templates (all of them when none is given).
        names: Vec<String>,
        /// The guest agent binary to install (default: next to `shoal`).
        #[arg(long, env = "SHOAL_GUEST_AGENT")]
        guest_agent: Option<PathBuf>,
        /// A Dockerfile to build on the API's fleet as the account's own.
        #[arg(short = 'f', long = "file")]
        file: Option<PathBuf>,
        /// With -f: the build context (what COPY and ADD read); the
        /// Dockerfile's directory when not given.
        #[arg(long, requires = "file")]
        context: Option<PathBuf>,
        /// With -f: print the build's id and return without following it.
        #[arg(long, requires = "file")]
        detach: bool,
    },
    /// The templates the account can use, from the API (SHOAL_API); with
    /// --local, the first-party bakes on this host and whether each bake's
    /// memory file is still what the bake wrote.
    List {
        #[command(flatten)]
        engine: EngineArgs,
        #[arg(long)]
        local: bool,
    },
    /// Publish an account's template to every account (an operator's
    /// command: it writes the database, as `token create` does).
    Publish(up::PublishArgs),
    /// Delete templates of the account's (their snapshots stay until no
    /// sandbox or template needs them).
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the settings of COMMAND (default: up), each with its source.
    Show {
        /// The command, e.g. `up`, `agent`, `template build`.
        command: Vec<String>,
    },
}

#[derive(Subcommand)]
enum HostCommand {
    /// Print a one-time token a new host joins the fleet with.
    JoinToken(fleet::JoinTokenArgs),
    /// Cut a host off: its credential stops working and its sandboxes are lost.
    Revoke(fleet::RevokeArgs),
    /// The fleet's hosts: address, state, capacity, sandboxes, heartbeat age.
    List(admin::HostListArgs),
    /// Place no new sandboxes on a host; those on it run on until they end.
    Drain(admin::HostDrainArgs),
    /// Undo a drain: the host takes new sandboxes again.
    Resume(admin::HostDrainArgs),
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Create an API token (and its account, if new); prints the token.
    Create(up::TokenArgs),
    /// An account's tokens: prefix, label, created, expiry (never the token).
    List(admin::TokenListArgs),
    /// Revoke one of an account's tokens by its prefix.
    Revoke(admin::TokenRevokeArgs),
}

#[derive(Subcommand)]
enum AccountCommand {
    /// Move an account to another tier (free, pro, team).
    SetTier(admin::SetTierArgs),
}

#[derive(Subcommand)]
enum SandboxCommand {
    /// Every live sandbox (or one account's), with its host.
    List(admin::SandboxListArgs),
    /// Delete sandboxes of any account; each host stops their VMs.
    Kill(admin::SandboxKillArgs),
}

#[derive(Subcommand)]
enum SnapshotCommand {
    /// Every snapshot (or one account's): size, host, whether it is being removed.
    List(admin::SnapshotListArgs),
    /// Remove snapshots of any account; each host deletes their files.
    Rm(admin::SnapshotRmArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Create, exec, fork and density on the real VM path.
    Engine(bench::EngineBenchArgs),
    /// Create, exec and GET through a running `shoal up`.
    Api(bench::ApiBenchArgs),
    /// Create through a fleet's front vs. one agent, placement decisions per
    /// second, and the spread of a burst of creates (see scripts/bench-fleet).
    Fleet(bench_fleet::FleetBenchArgs),
    /// The same job array on a real Slurm and on Shoal, and the sweep
    /// table's claims per second (see scripts/bench-sweep).
    Sweep(bench_sweep::SweepBenchArgs),
    /// The server's peak RSS growth over one plain exec that prints a lot
    /// (2 GB by default; issue 19's goal: under 64 MiB).
    ExecOutput(bench_exec::ExecOutputBenchArgs),
    /// A Dockerfile equal to code-interpreter built, rebuilt unchanged (the
    /// cache) and created from, against code-interpreter (issue 21).
    Template(bench_template::TemplateBenchArgs),
    /// Slurm bridge: live output's lag and a warm-start array against a
    /// cold one (issue 22).
    Slurm(bench_slurm::SlurmBenchArgs),
}

fn main() -> std::process::ExitCode {
    let (cli, command, from_file) = match parse_command_line() {
        Ok(parsed) => parsed,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            return std::process::ExitCode::from(2);
        }
    };
    cli.init_logging();
    if let Command::Config {
        command: ConfigCommand::Show { command: path },
    } = &cli.command
    {
        return match config::show(&command, &from_file, path) {
            Ok(text) => {
                print!("{text}");
                std::process::ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("error: {}", error_chain(&error));
                std::process::ExitCode::FAILURE
            }
        };
    }
    match &cli.command {
        Command::Completions { shell } => {
            let mut command = command;
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut command, "shoal", &mut script);
            // A reader that stops early (`| head`) is no error of ours.
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &script);
            return std::process::ExitCode::SUCCESS;
        }
        Command::Man { dir } => {
            return match write_manual(command, dir) {
                Ok(pages) => {
                    eprintln!("{pages} manual pages in {}", dir.display());
                    std::process::ExitCode::SUCCESS
                }
                Err(error) => {
                    eprintln!("error: {}", error_chain(&error));
                    std::process::ExitCode::FAILURE
                }
            };
        }
        _ => {}
    }
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The command line, read with every flag's SHOAL_* variable and the
/// configuration file wired in (`config`); clap's own errors and `--help`
/// exit here as `Cli::parse` would.
fn parse_command_line() -> Result<(Cli, clap::Command, config::FromFile)> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let file = config::ConfigFile::locate(&args)?;
    let (command, from_file) = config::wire(Cli::command(), &file)?;
    let matches = command.clone().get_matches_from(&args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    config::set_file(file);
    Ok((cli, command, from_file))
}

/// `shoal.1` and `shoal-COMMAND[-SUB].1` for every command, into `dir`;
/// how many pages were written.
fn write_manual(command: clap::Command, dir: &Path) -> Result<usize> {
    fn page(command: &clap::Command, name: &str, dir: &Path, written: &mut usize) -> Result<()> {
        let command = command.clone().name(config::leak(name.to_string()));
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(command.clone()).render(&mut out)?;
        std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))?;
        *written += 1;
        for sub in command.get_subcommands() {
            if !sub.is_hide_set() && sub.get_name() != "help" {
                page(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
            }
        }
        Ok(())
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = 0;
    let mut command = command;
    command.build();
    page(&command, "shoal", dir, &mut written)?;
    Ok(written)
}

fn error_chain(error: &anyhow::Error) -> String {
    error
        .chain()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(": ")
}

async fn run(cli: Cli) -> Result<std::process::ExitCode> {
    match cli.command {
        Command::Template {
            command:
                TemplateCommand::Build {
                    names,
                    file: Some(file),
                    context,
                    detach,
                    ..
                },
        } => {
            let [name] = names.as_slice() else {
                anyhow::bail!("with -f, name the one template to build: shoal template build -f Dockerfile NAME");
            };
            templates::build(
                name,
                &templates::RemoteBuildArgs {
                    file,
                    context,
                    detach,
                },
            )
            .await
        }
        Command::Template {
            command: TemplateCommand::Rm { names },
        } => templates::remove(&names).await,
        Command::Template {
            command: TemplateCommand::Publish(args),
        } => {
            up::publish(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Template {
            command: TemplateCommand::List { local: false, .. },
        } => templates::list().await,
        Command::Template {
            command:
                TemplateCommand::Build {
                    engine,
                    names,
                    guest_agent,
                    ..
                },
        } => {
            let engine = engine.open().await?;
            let agent = guest_agent_path(guest_agent)?;
            let names = if names.is_empty() {
                shoal_image::first_party_templates()
                    .into_iter()
                    .map(|t| t.name)
                    .collect()
            } else {
                names
            };
            let progress = indicatif::MultiProgress::new();
            for name in names {
                let manifest = engine
                    .build_template(&name, &agent, &progress)
                    .await
                    .with_context(|| format!("building template {name}"))?;
                println!(
                    "{name}: ready ({} vCPUs, {} MiB, {}, bake {:.12})",
                    manifest.vcpus, manifest.memory_mib, manifest.accel, manifest.input_hash
                );
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Template {
            command: TemplateCommand::List { engine, .. },
        } => {
            let engine = engine.open().await?;
            for spec in shoal_image::first_party_templates() {
                let started = std::time::Instant::now();
                let state = match engine.verified_template(&spec.name) {
                    Ok(_) => format!(
                        "baked, memory as baked (checked in {:.0} ms)",
                        started.elapsed().as_secs_f64() * 1e3
                    ),
                    Err(e) => shoal_engine::error::chain(&e),
                };
                println!(
                    "{:<18} {:>2} vCPUs {:>5} MiB  {}",
                    spec.name, spec.vcpus, spec.memory_mib, state
                );
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Run {
            engine,
            template,
            timeout,
            command,
        } => {
            let engine = engine.open().await?;
            let sandbox = engine.create(&template, None).await?;
            eprintln!(
                "sandbox {} ({template}) restored in {:.0} ms",
                sandbox.id, sandbox.restore_ms
            );
            let result = async {
                let agent = engine.agent(&sandbox.id).await?;
                let output = agent
                    .exec_collect(shoal_proto::client::ExecRequest {
                        cmd: command,
                        timeout: timeout.map(std::time::Duration::from_secs),
                        ..Default::default()
                    })
                    .await?;
                Ok::<_, shoal_engine::EngineError>(output)
            }
            .await;
            engine.kill(&sandbox.id).await?;
            let output = result?;
            use std::io::Write;
            std::io::stdout().write_all(&output.stdout)?;
            std::io::stderr().write_all(&output.stderr)?;
            let status = &output.status;
            if status.timed_out {
                eprintln!("timed out");
            }
            Ok(std::process::ExitCode::from(
                match (status.code, status.signal) {
                    (Some(code), _) => code.clamp(0, 255) as u8,
                    (None, Some(signal)) => (128 + signal).clamp(0, 255) as u8,
                    _ => 1,
                },
            ))
        }
        Command::Hold {
            engine,
            template,
            count,
            fork,
        } => {
            let engine = engine.open().await?;
            let mut ids = Vec::new();
            for _ in 0..count {
                let info = engine.create(&template, None).await?;
                println!("sandbox {} pid {}", info.id, info.pid.unwrap_or(0));
                ids.push(info.id);
            }
            if fork > 0 {
                let forked = engine.fork(&ids[0], fork).await?;
                for child in forked.children {
                    println!("sandbox {} pid {}", child.id, child.pid.unwrap_or(0));
                }
            }
            println!("holding");
            use std::io::Write;
            std::io::stdout().flush()?;
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
            }
        }
        Command::Up(args) => {
            up::up(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Server(args) => {
            fleet::server(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Agent(args) => {
            fleet::agent(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Host {
            command: HostCommand::JoinToken(args),
        } => {
            fleet::join_token(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Host {
            command: HostCommand::Revoke(args),
        } => {
            fleet::revoke(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Host {
            command: HostCommand::List(args),
        } => {
            admin::host_list(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Host {
            command: HostCommand::Drain(args),
        } => {
            admin::host_drain(args, true).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Host {
            command: HostCommand::Resume(args),
        } => {
            admin::host_drain(args, false).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Token { command } => {
            match command {
                TokenCommand::Create(args) => up::token(args).await?,
                TokenCommand::List(args) => admin::token_list(args).await?,
                TokenCommand::Revoke(args) => admin::token_revoke(args).await?,
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Account {
            command: AccountCommand::SetTier(args),
        } => {
            admin::set_tier(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Sandbox { command } => {
            match command {
                SandboxCommand::List(args) => admin::sandbox_list(args).await?,
                SandboxCommand::Kill(args) => admin::sandbox_kill(args).await?,
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Snapshot { command } => {
            match command {
                SnapshotCommand::List(args) => admin::snapshot_list(args).await?,
                SnapshotCommand::Rm(args) => admin::snapshot_rm(args).await?,
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Sbatch(args) => slurm::sbatch(args).await,
        Command::Squeue(args) => slurm::squeue(args).await,
        Command::Sacct(args) => slurm::sacct(args).await,
        Command::Scancel(args) => slurm::scancel(args).await,
        Command::Scontrol(args) => slurm::scontrol(args).await,
        Command::Debug(args) => slurm::debug(args).await,
        Command::Shell(args) => slurm::shell(args).await,
        Command::Seff(args) => slurm::seff(args).await,
        Command::Sinfo(args) => slurm::sinfo(args).await,
        Command::Sync(args) => slurm::sync(args).await,
        // Answered before the runtime starts (see `main`).
        Command::Config { .. } | Command::Completions { .. } | Command::Man { .. } => {
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Engine(args),
        } => {
            bench::engine(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Api(args),
        } => {
            bench::api(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Fleet(args),
        } => {
            bench_fleet::fleet(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Sweep(args),
        } => {
            bench_sweep::sweep(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::ExecOutput(args),
        } => {
            bench_exec::exec_output(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Template(args),
        } => {
            bench_template::template(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Command::Bench {
            command: BenchCommand::Slurm(args),
        } => {
            bench_slurm::slurm(args).await?;
            Ok(std::process::ExitCode::SUCCESS)
        }
    }
}

/// The guest agent binary: given, else the static (musl) build of this
/// workspace (`scripts/build-agent`), else `shoal-guest-agent` beside this
/// binary, else the Debian package's (`/usr/lib/shoal/shoal-guest-agent`
/// for `/usr/bin/shoal`: `<exe dir>/../lib/shoal/`). Only a static agent
/// runs on imported root filesystems.
fn guest_agent_path(given: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the shoal binary")?;
    let candidates = guest_agent_candidates(&exe);
    if let Some(found) = candidates.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    anyhow::bail!(
        "no guest agent at {}; build it with scripts/build-agent or pass --guest-agent",
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    )
}

/// Where [`guest_agent_path`] looks, in order, for the binary `exe`.
fn guest_agent_candidates(exe: &Path) -> Vec<PathBuf> {
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let mut candidates = Vec::new();
    if let Some(target) = dir.parent() {
        candidates.push(target.join("x86_64-unknown-linux-musl/release/shoal-guest-agent"));
    }
    candidates.push(dir.join("shoal-guest-agent"));
    if let Some(prefix) = dir.parent() {
        candidates.push(prefix.join("lib/shoal/shoal-guest-agent"));
    }
    candidates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_guest_agent_is_found_beside_the_packaged_binary() {
        assert_eq!(
            guest_agent_candidates(Path::new("/usr/bin/shoal")),
            [
                PathBuf::from("/usr/x86_64-unknown-linux-musl/release/shoal-guest-agent"),
                PathBuf::from("/usr/bin/shoal-guest-agent"),
                PathBuf::from("/usr/lib/shoal/shoal-guest-agent"),
            ]
        );
        assert_eq!(
            guest_agent_candidates(Path::new("/w/target/release/shoal"))[0],
            Path::new("/w/target/x86_64-unknown-linux-musl/release/shoal-guest-agent")
        );
    }
}
