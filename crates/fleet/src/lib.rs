//! The fleet: many hosts behind one API.
//!
//! A fleet is one PostgreSQL database, any number of stateless fronts
//! (`shoal server`, [`front`]) and one agent per host (`shoal agent`). An
//! agent is a host's engine with the control plane over it, exactly as in
//! `shoal up`, writing only its own rows (its `hosts` row through the
//! front's heartbeat route; sandboxes whose `host` is its name). The front
//! owns what needs the whole fleet in view: it authenticates, places
//! creates on hosts ([`shoal_placement`] over the heartbeats plus the
//! placements still in flight), routes every request about a sandbox to
//! the host that runs it, refuses what a gone host cannot answer, and marks
//! the sandboxes of hosts silent for [`STALE_AFTER`] `lost`.
//!
//! Owns: the front's routes and forwarding, the heartbeat protocol and
//! what a heartbeat reports ([`report`]).
//!
//! May not: touch VMs (agents do), shape sandbox JSON or decide quotas
//! (the agents' control planes do, on the shared database), or write SQL
//! (only through [`shoal_store::Store`]).

pub mod front;
pub mod limits;
pub mod report;

use std::time::Duration;

/// How often an agent reports.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// A host silent for longer is stale: nothing is placed on it and its
/// sandboxes are `lost`.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// The header-less bearer check every fleet-internal route uses: agents and
/// fronts share one fleet token.
fn fleet_token_matches(headers: &axum::http::HeaderMap, token: &str) -> bool {
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(shoal_store::bearer_token)
        .unwrap_or("");
    // Length first, then every byte: no early exit on the first mismatch.
    given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// What a front tells an agent at registration.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FleetConfig {
    /// The database the agents' control planes share with the fronts.
    pub database_url: String,
    pub heartbeat_interval_s: u64,
    pub stale_after_s: u64,
}
