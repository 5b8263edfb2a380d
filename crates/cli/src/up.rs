//! `shoal up` (one host: API, host agent and database in one process) and
//! `shoal token create`.

use anyhow::{Context, Result};
use shoal_control::readiness::{self, Readiness, RouterSwitch};
use shoal_control::{ControlConfig, ControlPlane};
use shoal_host::{HostAgent, HostConfig};
use shoal_store::{Store, Tier};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct UpArgs {
    #[command(flatten)]
    host: HostArgs,
    /// Address to serve the HTTP API on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    database: DatabaseArgs,
}

/// How a server speaks to the network (`up`, `server`, `agent`).
#[derive(clap::Args)]
pub struct TlsArgs {
    /// Serve HTTPS with this certificate chain (PEM); with --tls-key.
    #[arg(long, env = "SHOAL_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, env = "SHOAL_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Serve plain HTTP on an address that is not loopback (refused
    /// otherwise: tokens would cross the network in the clear).
    #[arg(long)]
    pub plain_http: bool,
}

impl TlsArgs {
    /// The HTTPS configuration for `listen`, or `None` for plain HTTP where
    /// that is allowed.
    pub async fn server_config(
        &self,
        listen: std::net::SocketAddr,
    ) -> Result<Option<axum_server::tls_rustls::RustlsConfig>> {
        let tls =
            shoal_fleet::tls::ServerTls::from_flags(self.tls_cert.clone(), self.tls_key.clone())
                .map_err(anyhow::Error::msg)?;
        shoal_fleet::tls::check_plain_http(listen, tls.as_ref(), self.plain_http)?;
        Ok(match tls {
            Some(tls) => Some(tls.config().await?),
            None => None,
        })
    }
}

/// `https` when serving TLS, else `http`.
pub fn scheme(tls: &Option<axum_server::tls_rustls::RustlsConfig>) -> &'static str {
    if tls.is_some() {
        "https"
    } else {
        "http"
    }
}

/// Serves `router` on `listener` until SIGTERM or Ctrl-C, over HTTPS when
/// `tls` is given; handlers may read the peer's address (`ConnectInfo`).
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    tls: Option<axum_server::tls_rustls::RustlsConfig>,
) -> Result<()> {
    use std::net::SocketAddr;
    let router = with_request_log(router);
    match tls {
        None => {
            // Answers are small and written whole: no reason to let Nagle
            // hold them.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        }
        Some(config) => {
            let handle = axum_server::Handle::new();
            let stopping = handle.clone();
            tokio::spawn(async move {
                shutdown_signal().await;
                stopping.graceful_shutdown(Some(std::time::Duration::from_secs(10)));
            });
            axum_server::from_tcp_rustls(listener.into_std()?, config)
                .handle(handle)
                .serve(router.into_make_service_with_connect_info::<SocketAddr>())
                .await?;
        }
    }
    Ok(())
}

/// Every request gets an id (the client's `x-request-id`, else a new
/// UUID), sent back in the answer's `x-request-id`, and a log line at info
/// when answered: method, path (never the query, which may hold a token),
/// status and milliseconds, in a span that carries the id, so that what a
/// handler logs names the request too.
fn with_request_log(router: axum::Router) -> axum::Router {
    use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
    use tower_http::trace::TraceLayer;
    let trace = TraceLayer::new_for_http()
        .make_span_with(|request: &axum::http::Request<_>| {
            let id = request
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(|v| &v[..v.len().min(64)])
                .unwrap_or("");
            tracing::info_span!(
                "request",
                id,
                method = %request.method(),
                path = request.uri().path(),
            )
        })
        .on_request(())
        .on_response(
            |response: &axum::http::Response<_>,
             latency: std::time::Duration,
             _: &tracing::Span| {
                tracing::info!(
                    status = response.status().as_u16(),
                    ms = latency.as_secs_f64() * 1e3,
                    "answered"
                );
            },
        )
        .on_failure(());
    router
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(trace)
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}

/// How a host runs its sandboxes (`shoal up` and `shoal agent`).
#[derive(clap::Args)]
pub struct HostArgs {
    #[command(flatten)]
    pub engine: super::EngineArgs,
    /// Sandboxes held in memory at once; more are refused with 503.
    #[arg(long)]
    pub max_sandboxes: Option<usize>,
    /// Memory (MiB) kept free on the host; creates that would go below are refused with 507.
    #[arg(long, default_value_t = 1024)]
    pub memory_reserve_mib: u64,
    /// The VMs' memory limits (guest RAM + overhead each) may add up to this
    /// times the host's memory less the reserve; more creates are refused
    /// with 503. Idle clones hold little of their RAM, hence > 1; 0: no limit.
    #[arg(long, default_value_t = shoal_host::DEFAULT_MEMORY_OVERCOMMIT)]
    pub memory_overcommit: f64,
    /// Space (MiB) kept free on the state dir's file system; creates, forks,
    /// wakes, snapshots and hibernations are refused with 507 while less is free.
    #[arg(long, default_value_t = shoal_host::DEFAULT_DISK_RESERVE_MIB)]
    pub disk_reserve_mib: u64,
    /// Sweep attempts starting at once (create, files, command start); 0
    /// for no limit. Default: one per two cores.
    #[arg(long)]
    pub sweep_max_starting: Option<usize>,
    /// CPU priority of a sweep's sandbox while its command runs: background
    /// (SCHED_IDLE, so other sandboxes' starts and collects go first) or
    /// normal.
    #[arg(long, default_value = "background")]
    pub sweep_command_priority: shoal_engine::CpuPriority,
    /// Seconds between idle-reaper passes.
    #[arg(long, default_value_t = 30)]
    pub reap_interval: u64,
    /// The guest agent binary to install in templates (default: next to `shoal`).
    #[arg(long, env = "SHOAL_GUEST_AGENT")]
    pub guest_agent: Option<PathBuf>,
    /// A registry tenants' template imports may pull from
    /// (`templates.register(name, "REGISTRY/REPO:TAG")`): a host name
    /// (HTTPS), `http://HOST:PORT` for one on this host's own network, or
    /// `docker.io`. Repeat for more; none by default, since the host makes
    /// the requests.
    #[arg(long = "registry", value_name = "REGISTRY")]
    pub registries: Vec<shoal_control::registry::Registry>,
    /// The bearer token Prometheus sends to scrape `/metrics`; without
    /// one, only peers on loopback may.
    #[arg(long, env = "SHOAL_METRICS_TOKEN")]
    pub metrics_token: Option<String>,
}

#[derive(clap::Args)]
pub struct DatabaseArgs {
    /// `postgres://...` or `sqlite:PATH`; default: SQLite at <state-dir>/shoal.db.
    #[arg(long, env = "SHOAL_DATABASE_URL")]
    pub database_url: Option<String>,
}

impl DatabaseArgs {
    pub(crate) fn url(&self, state_dir: &std::path::Path) -> String {
        self.database_url
            .clone()
            .unwrap_or_else(|| format!("sqlite:{}", state_dir.join("shoal.db").display()))
    }
}

#[derive(clap::Args)]
pub struct TokenArgs {
    /// The account the token acts for (made if new).
    #[arg(long)]
    account: String,
    #[arg(long, default_value = "free")]
    tier: String,
    #[command(flatten)]
    database: DatabaseArgs,
    /// Where the default SQLite database lives.
    #[arg(long, env = "SHOAL_STATE_DIR", default_value = "/var/lib/shoal")]
    state_dir: PathBuf,
}

#[derive(clap::Args)]
pub struct PublishArgs {
    /// The template (an account's own, built or named from a snapshot).
    name: String,
    /// The account whose template it is.
    #[arg(long)]
    account: String,
    /// Take it back: only its account may use it again.
    #[arg(long)]
    undo: bool,
    #[command(flatten)]
    database: DatabaseArgs,
    /// Where the default SQLite database lives.
    #[arg(long, env = "SHOAL_STATE_DIR", default_value = "/var/lib/shoal")]
    state_dir: PathBuf,
}

/// An operator's `shoal template publish`: one account's template, usable by
/// every account by name (its own of that name first).
pub async fn publish(args: PublishArgs) -> Result<()> {
    let store = Store::connect(&args.database.url(&args.state_dir)).await?;
    let result = async {
        let account = store
            .account_by_name(&args.account)
            .await?
            .with_context(|| format!("no account {}", args.account))?;
        let changed = store
            .set_template_published(account.id, &args.name, !args.undo)
            .await
            .map_err(|e| match e {
                shoal_store::StoreError::AlreadyExists { .. } => anyhow::anyhow!(
                    "another account's template called {} is published already",
                    args.name
                ),
                e => e.into(),
            })?;
        anyhow::ensure!(
            changed,
            "account {} has no template {}",
            args.account,
            args.name
        );
        let what = if args.undo {
            "its account's alone"
        } else {
            "published to every account"
        };
        println!("{}: {what}", args.name);
        Ok(())
    }
    .await;
    close_store(store).await;
    result
}

pub async fn token(args: TokenArgs) -> Result<()> {
    let tier: Tier = args
        .tier
        .parse()
        .context("--tier must be free, pro or team")?;
    let store = Store::connect(&args.database.url(&args.state_dir)).await?;
    let token = store.create_token(&args.account, tier).await?;
    eprintln!("API token for account {} ({tier} tier):", args.account);
    println!("{token}");
    close_store(store).await;
    Ok(())
}

pub async fn up(args: UpArgs) -> Result<()> {
    let url = args.database.url(&args.host.engine.state_dir);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let tls = args.tls.server_config(listener.local_addr()?).await?;
    let scheme = scheme(&tls);
    serve_host(HostServe {
        args: &args.host,
        database_url: url,
        host_name: "local".into(),
        listener,
        tls,
        only_fronts: None,
        started: Box::new(|address, store, host| {
            println!(
                "Shoal is up: {scheme}://{address} ({} database, {} accelerator)",
                store.backend(),
                host.engine().accel().as_str()
            );
            println!(
                "  token:  shoal token create --account NAME --tier free|pro|team{}",
                match &args.database.database_url {
                    Some(url) => format!(" --database-url {url}"),
                    None => format!(" --state-dir {}", args.host.engine.state_dir.display()),
                }
            );
            println!("  client: PANDASTACK_API={scheme}://{address} PANDASTACK_API_KEY=<token> python3 -c 'import pandastack'");
        }),
    })
    .await?;
    Ok(())
}

/// Called once the host's API is about to answer: the address it answers
/// on, its database and its host agent.
pub type OnStarted<'a> = Box<dyn FnOnce(std::net::SocketAddr, &Store, &Arc<HostAgent>) + Send + 'a>;

/// What one host serves with: `shoal up` alone, or as a fleet's agent.
pub struct HostServe<'a> {
    pub args: &'a HostArgs,
    pub database_url: String,
    /// The `host` of its sandboxes' rows.
    pub host_name: String,
    pub listener: tokio::net::TcpListener,
    /// HTTPS, or plain HTTP when `None`.
    pub tls: Option<axum_server::tls_rustls::RustlsConfig>,
    /// A fleet host answers only requests with this front key
    /// ([`shoal_fleet::only_fronts`]); `shoal up` answers everyone.
    pub only_fronts: Option<String>,
    pub started: OnStarted<'a>,
}

/// Opens the host agent, builds the first-party templates if needed, opens
/// the database, reconciles it with the host (waking the sandboxes the last
/// stop hibernated) and serves the API until SIGTERM or Ctrl-C; then
/// hibernates this host's sandboxes, for the next start to wake.
pub async fn serve_host(serve: HostServe<'_>) -> Result<Arc<HostAgent>> {
    let args = serve.args;
    // The port answers from the first moment: /healthz, and /readyz with
    // what the start is doing (baking templates takes minutes the first
    // time); the API's routes once all is done.
    let readiness = Readiness::new("opening the engine");
    let mut starting = readiness::starting_router(readiness.clone());
    if let Some(key) = &serve.only_fronts {
        starting = shoal_fleet::only_fronts(starting, key.clone());
    }
    let switch = RouterSwitch::new(starting);
    let address = serve.listener.local_addr()?;
    let mut server = tokio::spawn(serve_router(serve.listener, switch.router(), serve.tls));
    crate::notify::status("opening the engine, baking templates (the first start takes minutes)");
    let start = async {
        let host = open_host(args, Some(&readiness)).await?;
        readiness.phase("opening the database");
        // A fleet's agent opens the database with its own role, which may
        // not migrate the schema (the fronts do) nor read tokens (fronts
        // name the caller's account instead).
        let fleet_agent = serve.only_fronts.is_some();
        let store = if fleet_agent {
            Store::connect_as_host(&serve.database_url).await
        } else {
            Store::connect(&serve.database_url).await
        }
        .with_context(|| format!("opening the database {}", redacted(&serve.database_url)))?
        .with_rate_card(crate::config::file().rate_card()?);
        let mut config = ControlConfig {
            host_name: serve.host_name,
            account_header: fleet_agent.then_some(shoal_fleet::ACCOUNT_HEADER),
            registries: args.registries.clone(),
            limits: crate::config::file().tier_limits()?,
            metrics_token: args.metrics_token.clone(),
            ..ControlConfig::default()
        };
        config.lifecycle.reap_interval = std::time::Duration::from_secs(args.reap_interval.max(1));
        if let Some(n) = args.sweep_max_starting {
            config.sweeps.max_starting = n;
        }
        config.sweeps.command_priority = args.sweep_command_priority;
        let control = ControlPlane::new(store.clone(), host.clone(), config);
        readiness.phase("reconciling the database with the host, waking hibernated sandboxes");
        control.start_background().await.map_err(|e| {
            anyhow::anyhow!("reconciling the database with the host: {}", e.message)
        })?;
        anyhow::Ok((host, store, control))
    };
    let (host, store, control) = tokio::select! {
        started = start => started?,
        // SIGTERM or Ctrl-C while starting: nothing is served yet, and
        // whatever the engine adopted or woke keeps running for the next
        // start to adopt.
        served = &mut server => {
            served.context("the server task")??;
            anyhow::bail!("stopped before the service was ready");
        }
    };

    let mut router = shoal_control::router(control.clone());
    if let Some(key) = serve.only_fronts {
        router = shoal_fleet::only_fronts(router, key);
    }
    switch.serve(router);
    (serve.started)(address, &store, &host);
    use std::io::Write;
    std::io::stdout().flush()?;
    crate::notify::ready(&format!("serving on {address}"));
    tracing::info!(%address, "ready");
    server.await.context("the server task")??;
    // A planned stop keeps the sandboxes: hibernated now, woken by the
    // next start. What could not be hibernated stops with the process.
    eprintln!("shutting down: hibernating this host's sandboxes");
    let hibernated = control.hibernate_for_stop().await;
    eprintln!("shutting down: {hibernated} sandboxes hibernated; stopping the rest");
    host.engine().kill_running().await;
    close_store(store).await;
    Ok(host)
}

/// The host agent, with the first-party templates built (or checked).
pub async fn open_host(args: &HostArgs, readiness: Option<&Readiness>) -> Result<Arc<HostAgent>> {
    let mut engine = args.engine.config();
    engine.state_dir = args.engine.state_dir.clone();
    // The service owns its VMs' rows: what outlived a crash is adopted,
    // and the control plane's reconcile kills what no row claims.
    engine.adopt_survivors = true;
    let agent = super::guest_agent_path(args.guest_agent.clone())?;
    let host = HostAgent::open(HostConfig {
        engine,
        max_sandboxes: args.max_sandboxes,
        memory_reserve_mib: args.memory_reserve_mib,
        disk_reserve_mib: args.disk_reserve_mib,
        memory_overcommit: args.memory_overcommit,
        guest_agent: Some(agent.clone()),
    })
    .await
    .context("opening the host agent")?;
    let progress = indicatif::MultiProgress::new();
    let templates = shoal_image::first_party_templates();
    if let Some(readiness) = readiness {
        readiness.phase("baking templates (the first start takes minutes)");
        readiness.templates(templates.len());
    }
    for spec in templates {
        if let Some(readiness) = readiness {
            readiness.baking(&spec.name);
        }
        let manifest = host
            .engine()
            .build_template(&spec.name, &agent, &progress)
            .await
            .with_context(|| format!("building template {}", spec.name))?;
        // Hashed now, so the first create does not pay for it.
        host.engine()
            .verified_template(&spec.name)
            .with_context(|| format!("checking template {}", spec.name))?;
        eprintln!(
            "template {}: ready ({} vCPUs, {} MiB, {})",
            spec.name, manifest.vcpus, manifest.memory_mib, manifest.accel
        );
        if let Some(readiness) = readiness {
            readiness.template_ready();
        }
    }
    Ok(host)
}

/// A database URL fit for a message: without its password.
pub(crate) fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.into()
        }
        _ => url.to_owned(),
    }
}

/// Closes the database pool, but does not let a database that went away
/// first hold the process up: after SIGTERM it must exit.
pub async fn close_store(store: Store) {
    if tokio::time::timeout(std::time::Duration::from_secs(5), store.close())
        .await
        .is_err()
    {
        eprintln!("shutting down: the database did not answer; leaving it");
    }
}

pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    crate::notify::stopping();
}
