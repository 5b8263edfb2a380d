//! `shoal server` (a fleet's stateless front) and `shoal agent` (one host
//! of a fleet). What they do is in `shoal-fleet`; this module turns flags
//! into it.

use crate::up::{scheme, serve_host, HostArgs, HostServe, TlsArgs};
use anyhow::{bail, Context, Result};
use shoal_fleet::front::{Front, FrontConfig};
use shoal_fleet::report::{Identity, Reporter};
use shoal_fleet::FleetConfig;
use shoal_store::Store;
use std::sync::Arc;

/// How long `shoal agent` waits for a front that does not answer yet.
const REGISTER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(300);

#[derive(clap::Args)]
pub struct ServerArgs {
    /// The fleet's database (PostgreSQL), shared with the agents.
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    database_url: String,
    /// Address to serve the API on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: String,
    /// The fronts' own secret: operators' fleet routes take it, and each
    /// host gets a key derived from it (never the secret itself).
    #[arg(long, env = "SHOAL_FLEET_TOKEN")]
    fleet_token: String,
    /// The database URL agents are told to use, when it differs from
    /// `--database-url` as seen from here (another address of the server).
    #[arg(long)]
    agent_database_url: Option<String>,
    /// The CA the agents' certificates chain to, pinned for every request
    /// to an https:// agent.
    #[arg(long, env = "SHOAL_AGENT_CA")]
    agent_ca: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
    /// A tier's request rate at this front, TIER=PER_SECOND/BURST
    /// (default free=50/200, pro=100/400, team=200/800); repeatable.
    #[arg(long)]
    account_rate: Vec<String>,
    /// Invalid tokens one address may send in a minute before it is
    /// refused (429) for a minute.
    #[arg(long, default_value_t = 20)]
    bad_token_limit: u32,
}

#[derive(clap::Args)]
pub struct AgentArgs {
    /// A front of the fleet (`shoal server`), e.g. http://10.0.0.1:8080.
    #[arg(long, env = "SHOAL_CONTROL_PLANE")]
    control_plane: String,
    /// A one-time join token (`shoal host join-token`), needed the first
    /// time; the credential it buys is kept in the state dir.
    #[arg(long, env = "SHOAL_JOIN_TOKEN")]
    join_token: Option<String>,
    /// Address to serve this host's API on (fronts forward to it, with
    /// this host's front key; nothing else is answered).
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: String,
    /// The URL fronts reach this agent at (default: http(s)://<listen>).
    #[arg(long)]
    advertise: Option<String>,
    /// The CA the front's certificate chains to, pinned for every request
    /// to it (default: the web's roots).
    #[arg(long, env = "SHOAL_CA_FILE")]
    ca_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
    /// This host's name in the fleet (default: the machine's hostname).
    #[arg(long)]
    name: Option<String>,
    /// The fleet's database; by default the front hands it out.
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    database_url: Option<String>,
    #[command(flatten)]
    host: HostArgs,
}

pub async fn server(args: ServerArgs) -> Result<()> {
    if args.fleet_token.len() < 16 {
        bail!("--fleet-token must be at least 16 characters");
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let tls = args.tls.server_config(listener.local_addr()?).await?;
    let store = Store::connect(&args.database_url).await.with_context(|| {
        format!(
            "opening the database {}",
            crate::up::redacted(&args.database_url)
        )
    })?;
    let mut limits = shoal_fleet::limits::FrontLimits {
        failed_auth_limit: args.bad_token_limit,
        ..Default::default()
    };
    for spec in &args.account_rate {
        limits
            .set_account_rate(spec)
            .map_err(|e| anyhow::anyhow!("--account-rate {e}"))?;
    }
    let front = Front::with_limits(
        store.clone(),
        FrontConfig {
            fleet_token: args.fleet_token,
            agent_ca: args.agent_ca,
            database_url: args.agent_database_url.unwrap_or(args.database_url),
            lost_check: std::time::Duration::from_secs(5),
        },
        limits,
    )
    .context("--agent-ca")?;
    front.spawn_lost_marker();
    println!(
        "Shoal fleet front: {}://{} ({} database); hosts join with: shoal agent --control-plane URL --join-token $(shoal host join-token)",
        scheme(&tls),
        listener.local_addr()?,
        store.backend()
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    crate::notify::ready(&format!("serving on {}", listener.local_addr()?));
    crate::up::serve_router(listener, shoal_fleet::front::router(front), tls).await?;
    crate::up::close_store(store).await;
    Ok(())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into())
}

/// A joined host's credential, kept at [`CREDENTIAL_FILE`] in its state
/// dir (mode 0600) so that restarts need no new join token.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredCredential {
    name: String,
    control_plane: String,
    host_secret: String,
}

const CREDENTIAL_FILE: &str = "fleet-host.json";

/// The host's credential and the fleet's configuration: from the stored
/// credential when it is this host's and still stands, else by spending
/// the join token.
async fn credential(
    args: &AgentArgs,
    http: &reqwest::Client,
    name: &str,
) -> Result<(String, FleetConfig)> {
    use shoal_fleet::report::{fetch_config, join, patiently, ReportError};
    let path = args.host.engine.state_dir.join(CREDENTIAL_FILE);
    let stored = std::fs::read(&path)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<StoredCredential>(&bytes).ok())
        .filter(|c| c.name == name && c.control_plane == args.control_plane);
    if let Some(stored) = stored {
        let fetched = patiently(REGISTER_PATIENCE, || {
            fetch_config(http, &args.control_plane, &stored.host_secret)
        })
        .await;
        match fetched {
            Ok(config) => return Ok((stored.host_secret, config)),
            Err(ReportError::Refused { status, body })
                if status == reqwest::StatusCode::UNAUTHORIZED && args.join_token.is_some() =>
            {
                eprintln!("the stored credential of host {name} was refused ({body}): joining again");
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "host {name}'s credential ({}) was not accepted; if the host was revoked, join again with --join-token",
                        path.display()
                    )
                })
            }
        }
    }
    let Some(join_token) = &args.join_token else {
        bail!(
            "host {name} has not joined the fleet: pass --join-token (make one on the control plane with `shoal host join-token`)"
        );
    };
    let joined = patiently(REGISTER_PATIENCE, || {
        join(http, &args.control_plane, name, join_token)
    })
    .await
    .context("joining the fleet")?;
    let stored = StoredCredential {
        name: name.to_owned(),
        control_plane: args.control_plane.clone(),
        host_secret: joined.host_secret.clone(),
    };
    write_private(&path, &serde_json::to_vec_pretty(&stored)?)
        .with_context(|| format!("keeping the host credential in {}", path.display()))?;
    Ok((joined.host_secret, joined.config))
}

/// Writes a file only its owner can read, durably, replacing it whole.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let partial = path.with_extension("json.tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&partial, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

pub async fn agent(args: AgentArgs) -> Result<()> {
    let name = args.name.clone().unwrap_or_else(hostname);
    if !shoal_fleet::valid_host_name(&name) {
        bail!("--name {name:?}: a host name is 1 to 63 letters, digits, '-', '_' or '.'");
    }
    let http = shoal_fleet::tls::client(args.ca_file.as_deref())?;
    let (host_secret, config) = credential(&args, &http, &name).await?;
    let database_url = args.database_url.clone().unwrap_or(config.database_url);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let address = listener.local_addr()?;
    let tls = args.tls.server_config(address).await?;
    let scheme = scheme(&tls);
    let identity = Identity {
        name: name.clone(),
        url: args
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{address}")),
        max_sandboxes: args.host.max_sandboxes.map(|m| m as u32),
        reserve_mib: args.host.memory_reserve_mib,
    };
    let control_plane = args.control_plane.clone();
    serve_host(HostServe {
        args: &args.host,
        database_url,
        host_name: name,
        listener,
        tls,
        only_fronts: Some(config.front_key),
        started: Box::new(move |address, _store, host| {
            println!(
                "Shoal agent {} on {scheme}://{address}, reporting to {control_plane}",
                identity.name
            );
            let reporter = Arc::new(Reporter::new(
                http,
                &control_plane,
                &host_secret,
                identity,
                host.clone(),
            ));
            reporter.spawn();
        }),
    })
    .await?;
    Ok(())
}

#[derive(clap::Args)]
pub struct JoinTokenArgs {
    /// The fleet's database (PostgreSQL).
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    database_url: String,
    /// How long the token may be spent, in seconds.
    #[arg(long, default_value_t = 3600)]
    ttl_seconds: u64,
}

/// `shoal host join-token`: prints a one-time token a new host joins with.
pub async fn join_token(args: JoinTokenArgs) -> Result<()> {
    let store = Store::connect(&args.database_url).await?;
    let token = store
        .create_join_token(shoal_control::now(), args.ttl_seconds as f64)
        .await?;
    eprintln!(
        "join token (one host, once, within {} s): shoal agent --join-token TOKEN ...",
        args.ttl_seconds
    );
    println!("{token}");
    crate::up::close_store(store).await;
    Ok(())
}

#[derive(clap::Args)]
pub struct RevokeArgs {
    /// The host's name in the fleet.
    name: String,
    /// The fleet's database (PostgreSQL).
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    database_url: String,
}

/// `shoal host revoke NAME`: the host's credential stops working, it gets
/// no more work and its sandboxes are `lost`.
pub async fn revoke(args: RevokeArgs) -> Result<()> {
    let store = Store::connect(&args.database_url).await?;
    let revoked = store.revoke_host(&args.name, shoal_control::now()).await?;
    crate::up::close_store(store).await;
    match revoked {
        Some(lost) => {
            println!(
                "host {} revoked; {} sandbox(es) lost{}",
                args.name,
                lost.len(),
                if lost.is_empty() {
                    String::new()
                } else {
                    format!(": {}", lost.join(" "))
                }
            );
            Ok(())
        }
        None => bail!("no standing credential for host {}", args.name),
    }
}
