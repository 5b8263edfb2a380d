//! A real host agent for tests that drive the control plane: its own state
//! dir, the shared template cache, no capacity limits, code-interpreter
//! built (or found current).

use shoal_host::{HostAgent, HostConfig};
use std::sync::Arc;

/// Opens a host agent in the state dir of test binary `test`. Callers keep
/// one per binary (a `OnceCell`): the engine holds its state dir's lock.
pub async fn host_agent(test: &str) -> Arc<HostAgent> {
    let mut engine = shoal_host::EngineConfig::new(crate::state_dir(test));
    engine.cache_dir = crate::cache_dir();
    let host = HostAgent::open(HostConfig {
        engine,
        max_sandboxes: None,
        memory_reserve_mib: 0,
        memory_overcommit: shoal_host::DEFAULT_MEMORY_OVERCOMMIT,
        disk_reserve_mib: 0,
        guest_agent: Some(crate::guest_agent().to_owned()),
    })
    .await
    .expect("opening the host agent");
    let progress =
        indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden());
    host.engine()
        .build_template("code-interpreter", crate::guest_agent(), &progress)
        .await
        .expect("building code-interpreter");
    host
}
