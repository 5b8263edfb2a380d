//! The agent's side of the fleet: what a host reports and how often.
//!
//! Every [`HEARTBEAT_INTERVAL`] the agent measures itself (CPU busy since
//! the last report, memory from `/proc/meminfo`, the sandboxes its engine
//! holds and their Pss) and posts it to a front, which writes the host's
//! row. A front that cannot be reached is retried at the next beat; three
//! missed beats make the host stale.

use crate::{FleetConfig, JoinRequest, Joined, HEARTBEAT_INTERVAL};
use shoal_host::{HostAgent, VmState};
use shoal_store::HostReport;
use std::sync::Arc;

/// Who this agent is to the fleet.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Unique in the fleet; also the `host` of its sandboxes' rows.
    pub name: String,
    /// Where fronts reach its API.
    pub url: String,
    pub max_sandboxes: Option<u32>,
    pub reserve_mib: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("the control plane at {url} cannot be reached: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("the control plane refused: {status}: {body}")]
    Refused {
        status: reqwest::StatusCode,
        body: String,
    },
}

/// Posts heartbeats to a front.
pub struct Reporter {
    control_plane: String,
    /// This host's credential ([`join`]).
    host_secret: String,
    identity: Identity,
    host: Arc<HostAgent>,
    http: reqwest::Client,
    last_cpu: std::sync::Mutex<Option<CpuTimes>>,
}

#[derive(Debug, Clone, Copy)]
struct CpuTimes {
    busy: u64,
    total: u64,
}

/// The `cpu` line of `/proc/stat`: busy and total jiffies.
fn cpu_times() -> Option<CpuTimes> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().sum();
    // idle and iowait are the 4th and 5th fields.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    Some(CpuTimes {
        busy: total.saturating_sub(idle),
        total,
    })
}

/// `MemTotal` and `MemAvailable`, in MiB.
fn memory_mib() -> (u64, u64) {
    let field = |name: &str| shoal_host::meminfo_mib(name).unwrap_or(0);
    (field("MemTotal:"), field("MemAvailable:"))
}

impl Reporter {
    /// `http` reaches the front (its CA pinned: [`crate::tls::client`]).
    pub fn new(
        http: reqwest::Client,
        control_plane: &str,
        host_secret: &str,
        identity: Identity,
        host: Arc<HostAgent>,
    ) -> Reporter {
        Reporter {
            control_plane: control_plane.trim_end_matches('/').to_owned(),
            host_secret: host_secret.to_owned(),
            identity,
            host,
            http,
            last_cpu: std::sync::Mutex::new(cpu_times()),
        }
    }

    /// What the host looks like now.
    pub async fn measure(&self) -> HostReport {
        let held: Vec<_> = self
            .host
            .engine()
            .list()
            .await
            .into_iter()
            .filter(|s| s.state != VmState::Hibernated)
            .collect();
        let pss_bytes: u64 = held
            .iter()
            .filter_map(|s| self.host.engine().usage(&s.id).ok().flatten())
            .map(|u| u.pss_bytes)
            .sum();
        let cpu_busy = {
            let mut last = self.last_cpu.lock().unwrap();
            let current = cpu_times();
            let busy = match (*last, current) {
                (Some(a), Some(b)) if b.total > a.total => {
                    (b.busy.saturating_sub(a.busy)) as f64 / (b.total - a.total) as f64
                }
                _ => 0.0,
            };
            *last = current;
            busy.clamp(0.0, 1.0)
        };
        let (memory_mib, available_mib) = memory_mib();
        HostReport {
            id: self.identity.name.clone(),
            url: self.identity.url.clone(),
            vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            cpu_busy,
            memory_mib,
            available_mib,
            reserve_mib: self.identity.reserve_mib,
            sandboxes: held.len() as u32,
            max_sandboxes: self.identity.max_sandboxes,
            pss_mib: pss_bytes >> 20,
            draining: false,
        }
    }

    /// Sends one heartbeat.
    pub async fn beat(&self) -> Result<(), ReportError> {
        let report = self.measure().await;
        let url = format!("{}/v1/fleet/heartbeat", self.control_plane);
        let request = self
            .http
            .post(&url)
            .bearer_auth(&self.host_secret)
            .json(&report)
            .timeout(HEARTBEAT_INTERVAL);
        send(request, &url).await?;
        Ok(())
    }

    /// Beats forever, every [`HEARTBEAT_INTERVAL`].
    pub fn spawn(self: Arc<Self>) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut cut_off = false;
            loop {
                tick.tick().await;
                match self.beat().await {
                    Ok(()) => cut_off = false,
                    // Revoked (`shoal host revoke`): the fleet has marked this
                    // host's sandboxes lost and its database role no longer
                    // logs in, so nothing here may go on running them.
                    Err(ReportError::Refused { status, body })
                        if status == reqwest::StatusCode::UNAUTHORIZED =>
                    {
                        tracing::warn!(body, "heartbeat refused");
                        if !cut_off {
                            cut_off = true;
                            tracing::error!(
                                "this host's credential is not accepted (revoked?): stopping its VMs"
                            );
                            self.host.engine().kill_all().await;
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "heartbeat"),
                }
            }
        });
    }
}

/// Asks a front for the fleet's configuration (the database to share, the
/// key fronts will present), as the host `host_secret` speaks for.
pub async fn fetch_config(
    http: &reqwest::Client,
    control_plane: &str,
    host_secret: &str,
) -> Result<FleetConfig, ReportError> {
    let url = format!("{}/v1/fleet/config", control_plane.trim_end_matches('/'));
    json_answer(http.get(&url).bearer_auth(host_secret), url).await
}

/// Joins the fleet as host `name` with a one-time join token: the host's
/// own credential and the configuration.
pub async fn join(
    http: &reqwest::Client,
    control_plane: &str,
    name: &str,
    join_token: &str,
) -> Result<Joined, ReportError> {
    let url = format!("{}/v1/fleet/join", control_plane.trim_end_matches('/'));
    let request = http.post(&url).json(&JoinRequest {
        name: name.to_owned(),
        join_token: join_token.to_owned(),
    });
    json_answer(request, url).await
}

/// [`send`], and the answer's JSON body.
async fn json_answer<T: serde::de::DeserializeOwned>(
    request: reqwest::RequestBuilder,
    url: String,
) -> Result<T, ReportError> {
    send(request, &url)
        .await?
        .json()
        .await
        .map_err(|source| ReportError::Unreachable { url, source })
}

/// `call` ([`fetch_config`] or [`join`]), retried while the front cannot be
/// reached, for at most `patience`. Agents and fronts start in any order (a
/// host that boots before the front, a front restarting): an agent waits
/// for its front as `slurmd` waits for `slurmctld`, rather than exiting on
/// the first refused connection. A front that answers with a refusal (a
/// spent join token, a revoked credential) is not retried.
pub async fn patiently<T, F, Fut>(patience: std::time::Duration, call: F) -> Result<T, ReportError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, ReportError>>,
{
    use std::time::{Duration, Instant};
    let give_up = Instant::now() + patience;
    let mut pause = Duration::from_millis(100);
    loop {
        match call().await {
            Err(e @ ReportError::Unreachable { .. }) if Instant::now() + pause < give_up => {
                tracing::warn!(error = %e, "waiting for the control plane");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            done => return done,
        }
    }
}

/// Sends a request to a front; an answer other than 2xx is a refusal.
async fn send(
    request: reqwest::RequestBuilder,
    url: &str,
) -> Result<reqwest::Response, ReportError> {
    let answer = request
        .send()
        .await
        .map_err(|source| ReportError::Unreachable {
            url: url.to_owned(),
            source,
        })?;
    if !answer.status().is_success() {
        return Err(ReportError::Refused {
            status: answer.status(),
            body: answer.text().await.unwrap_or_default(),
        });
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A port nothing listens on yet, and a front that starts there after
    /// `delay` and answers `status` with a fleet configuration.
    async fn front_after(delay: Duration, status: u16) -> String {
        let port = shoal_testkit::free_port();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .unwrap();
            let config = FleetConfig {
                database_url: "postgres://fleet".into(),
                front_key: "key".into(),
                heartbeat_interval_s: 2,
                stale_after_s: 6,
            };
            let app = axum::Router::new().route(
                "/v1/fleet/config",
                axum::routing::get(move || async move {
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        axum::Json(config),
                    )
                }),
            );
            axum::serve(listener, app).await.unwrap();
        });
        format!("http://127.0.0.1:{port}")
    }

    #[tokio::test]
    async fn an_agent_started_before_its_front_waits_for_it() {
        let http = reqwest::Client::new();
        let front = front_after(Duration::from_millis(700), 200).await;
        assert!(matches!(
            fetch_config(&http, &front, "t").await,
            Err(ReportError::Unreachable { .. })
        ));
        let config = patiently(Duration::from_secs(30), || fetch_config(&http, &front, "t"))
            .await
            .unwrap();
        assert_eq!(config.database_url, "postgres://fleet");
    }

    #[tokio::test]
    async fn a_refusal_or_a_front_that_never_comes_ends_the_wait() {
        let http = reqwest::Client::new();
        let refusing = front_after(Duration::ZERO, 401).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let start = Instant::now();
        assert!(matches!(
            patiently(Duration::from_secs(30), || fetch_config(
                &http, &refusing, "t"
            ))
            .await,
            Err(ReportError::Refused { .. })
        ));
        assert!(start.elapsed() < Duration::from_secs(5));

        let absent = front_after(Duration::from_secs(3600), 200).await;
        let start = Instant::now();
        assert!(matches!(
            patiently(Duration::from_secs(1), || fetch_config(&http, &absent, "t")).await,
            Err(ReportError::Unreachable { .. })
        ));
        assert!(start.elapsed() < Duration::from_secs(3));
    }
}
