//! `shoal server` (a fleet's stateless front) and `shoal agent` (one host
//! of a fleet). What they do is in `shoal-fleet`; this module turns flags
//! into it.

use crate::up::{serve_host, HostArgs, HostServe};
use anyhow::{bail, Context, Result};
use shoal_fleet::front::{Front, FrontConfig};
use shoal_fleet::report::{Identity, Reporter};
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
    /// Shared secret of the fleet's fronts and agents.
    #[arg(long, env = "SHOAL_FLEET_TOKEN")]
    fleet_token: String,
    /// The database URL agents are told to use, when it differs from
    /// `--database-url` as seen from here (another address of the server).
    #[arg(long)]
    agent_database_url: Option<String>,
}

#[derive(clap::Args)]
pub struct AgentArgs {
    /// A front of the fleet (`shoal server`), e.g. http://10.0.0.1:8080.
    #[arg(long, env = "SHOAL_CONTROL_PLANE")]
    control_plane: String,
    /// Shared secret of the fleet's fronts and agents.
    #[arg(long, env = "SHOAL_FLEET_TOKEN")]
    fleet_token: String,
    /// Address to serve this host's API on (fronts forward to it).
    #[arg(long, default_value = "0.0.0.0:8081")]
    listen: String,
    /// The URL fronts reach this agent at (default: http://<listen>).
    #[arg(long)]
    advertise: Option<String>,
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
    let store = Store::connect(&args.database_url)
        .await
        .with_context(|| format!("opening the database {}", args.database_url))?;
    let front = Front::new(
        store.clone(),
        FrontConfig {
            fleet_token: args.fleet_token,
            database_url: args.agent_database_url.unwrap_or(args.database_url),
            lost_check: std::time::Duration::from_secs(5),
        },
    );
    front.spawn_lost_marker();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    println!(
        "Shoal fleet front: http://{} ({} database); agents: shoal agent --control-plane URL --fleet-token ...",
        listener.local_addr()?,
        store.backend()
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(
        listener,
        shoal_fleet::front::router(front)
            .into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(crate::up::shutdown_signal())
    .await?;
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

pub async fn agent(args: AgentArgs) -> Result<()> {
    let database_url = match &args.database_url {
        Some(url) => url.clone(),
        None => {
            shoal_fleet::report::fetch_config_patiently(
                &args.control_plane,
                &args.fleet_token,
                REGISTER_PATIENCE,
            )
            .await
            .context("registering with the control plane")?
            .database_url
        }
    };
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let address = listener.local_addr()?;
    let identity = Identity {
        name: args.name.clone().unwrap_or_else(hostname),
        url: args
            .advertise
            .clone()
            .unwrap_or_else(|| format!("http://{address}")),
        max_sandboxes: args.host.max_sandboxes.map(|m| m as u32),
        reserve_mib: args.host.memory_reserve_mib,
    };
    let control_plane = args.control_plane.clone();
    let fleet_token = args.fleet_token.clone();
    serve_host(HostServe {
        args: &args.host,
        database_url,
        host_name: identity.name.clone(),
        listener,
        started: Box::new(move |address, _store, host| {
            println!(
                "Shoal agent {} on http://{address}, reporting to {control_plane}",
                identity.name
            );
            let reporter = Arc::new(Reporter::new(
                &control_plane,
                &fleet_token,
                identity,
                host.clone(),
            ));
            reporter.spawn();
        }),
    })
    .await?;
    Ok(())
}
