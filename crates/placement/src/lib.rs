//! Placement: which host a new sandbox goes to.
//!
//! Owns the decision only, as a pure function of the request and a
//! [`HostCapacity`] snapshot per host: score every host that fits on its
//! free CPU and free memory and take the best, so load spreads. The seed's
//! rule: no job declares a duration, so there is no model of the future and
//! no backfill; a host is as good as what it has free now.
//!
//! May not: read a clock or a database, or know HTTP. The caller (the
//! control plane) builds the snapshot from the hosts' last heartbeats and
//! the in-flight reservations it made since, decides which hosts are stale,
//! records the reservation this function picks, and maps [`PlacementError`]
//! to status codes.
//!
//! The one tricky thing: heartbeats arrive every 10 s, and a burst of
//! creates lands between two of them. A host's reported figures are
//! therefore reduced by the creates placed on it since its heartbeat
//! ([`HostCapacity::in_flight`]), otherwise every create of the burst would
//! see the same "emptiest" host.

use serde::{Deserialize, Serialize};

/// What a host last reported, plus what was placed on it since.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCapacity {
    pub id: String,
    /// False when its heartbeat is too old (the caller's rule: 30 s), or
    /// it is draining. A host that is not live is never chosen.
    pub live: bool,
    /// Host CPUs.
    pub vcpus: u32,
    /// Fraction of the host's CPU time busy over its last heartbeat period,
    /// 0.0 to 1.0.
    pub cpu_busy: f64,
    /// Total memory of the host.
    pub memory_mib: u64,
    /// Memory available to new sandboxes at the last heartbeat
    /// (`MemAvailable`).
    pub available_mib: u64,
    /// Memory the host keeps for itself: never placed into.
    pub reserve_mib: u64,
    /// Sandboxes held at the last heartbeat.
    pub sandboxes: u32,
    /// Sandboxes the host holds at most, if it has a limit.
    pub max_sandboxes: Option<u32>,
    /// Creates placed on the host since its last heartbeat, with the memory
    /// and CPU they were estimated to take.
    pub in_flight: InFlight,
}

/// Creates placed on a host that its last heartbeat does not show yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    pub sandboxes: u32,
    pub memory_mib: u64,
    /// Sum of the CPU share each is expected to use (see
    /// [`Request::cpu_share`]).
    pub cpu_share: f64,
}

/// One sandbox to place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Memory the sandbox is expected to take on the host: its resident
    /// size, not its nominal RAM (restored clones share the template's
    /// pages, so a 2 GiB sandbox costs the host tens of MiB until it writes).
    pub memory_mib: u64,
    /// Host CPUs the sandbox is expected to keep busy (an idle sandbox:
    /// close to 0; a sweep cell: about 1).
    pub cpu_share: f64,
    /// The only host it may go to: a fork goes to its parent's host, a
    /// create with a volume to the volume's host.
    pub pinned_to: Option<String>,
}

/// Why nothing was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No live host has room: retry later.
    #[error("no compute capacity available")]
    NoCapacity,
    /// The host the request is pinned to is stale or unknown.
    #[error("sandbox host unavailable")]
    PinnedHostUnavailable,
}

/// Weight of free CPU against free memory in a host's score.
const CPU_WEIGHT: f64 = 0.5;

/// The host the request should go to.
///
/// Among live hosts where it fits, the one with the highest score: the
/// free fraction of CPU and of memory that would be left after placing it,
/// weighted equally. Equal scores go to the host holding fewer sandboxes,
/// then to the first in `hosts`' order (callers shuffle or sort as they
/// like).
pub fn place<'a>(
    request: &Request,
    hosts: &'a [HostCapacity],
) -> Result<&'a HostCapacity, PlacementError> {
    if let Some(pinned) = &request.pinned_to {
        let host = hosts
            .iter()
            .find(|h| &h.id == pinned && h.live)
            .ok_or(PlacementError::PinnedHostUnavailable)?;
        return if fits(request, host) {
            Ok(host)
        } else {
            Err(PlacementError::NoCapacity)
        };
    }
    let mut best: Option<(&HostCapacity, f64)> = None;
    for host in hosts.iter().filter(|h| h.live && fits(request, h)) {
        let score = score(request, host);
        let better = match best {
            None => true,
            Some((current, current_score)) => {
                score > current_score + f64::EPSILON
                    || ((score - current_score).abs() <= f64::EPSILON && held(host) < held(current))
            }
        };
        if better {
            best = Some((host, score));
        }
    }
    best.map(|(host, _)| host).ok_or(PlacementError::NoCapacity)
}

/// Memory left for sandboxes once what was placed since the heartbeat is
/// taken out.
fn free_mib(host: &HostCapacity) -> u64 {
    host.available_mib
        .saturating_sub(host.in_flight.memory_mib)
        .saturating_sub(host.reserve_mib)
}

fn held(host: &HostCapacity) -> u32 {
    host.sandboxes + host.in_flight.sandboxes
}

/// Whether the request fits: memory beyond the reserve, and a free slot.
/// CPU is never a reason to refuse: idle sandboxes cost none, and a busy
/// host only scores lower.
pub fn fits(request: &Request, host: &HostCapacity) -> bool {
    let slot = host.max_sandboxes.is_none_or(|max| held(host) < max);
    slot && free_mib(host) >= request.memory_mib
}

/// The free fractions left after placing the request, weighted.
fn score(request: &Request, host: &HostCapacity) -> f64 {
    let vcpus = f64::from(host.vcpus.max(1));
    let busy = host.cpu_busy.clamp(0.0, 1.0) * vcpus + host.in_flight.cpu_share + request.cpu_share;
    let cpu_free = (1.0 - busy / vcpus).max(0.0);
    let memory = host.memory_mib.max(1) as f64;
    let memory_free = free_mib(host).saturating_sub(request.memory_mib) as f64 / memory;
    CPU_WEIGHT * cpu_free + (1.0 - CPU_WEIGHT) * memory_free
}

/// Records a placement in the snapshot, as the caller's reservation will
/// until the host's next heartbeat: what a burst of decisions made from one
/// snapshot must do between two of them.
pub fn reserve(request: &Request, host: &mut HostCapacity) {
    host.in_flight.sandboxes += 1;
    host.in_flight.memory_mib += request.memory_mib;
    host.in_flight.cpu_share += request.cpu_share;
}

/// Max over mean of the sandboxes held per host: 1.0 is a perfect spread.
pub fn spread_max_over_mean(counts: &[u32]) -> f64 {
    if counts.is_empty() {
        return 0.0;
    }
    let total: u32 = counts.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let mean = f64::from(total) / counts.len() as f64;
    f64::from(*counts.iter().max().unwrap_or(&0)) / mean
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(id: &str) -> HostCapacity {
        HostCapacity {
            id: id.into(),
            live: true,
            vcpus: 2,
            cpu_busy: 0.1,
            memory_mib: 24_000,
            available_mib: 20_000,
            reserve_mib: 1_024,
            sandboxes: 0,
            max_sandboxes: None,
            in_flight: InFlight::default(),
        }
    }

    fn sandbox() -> Request {
        Request {
            memory_mib: 64,
            cpu_share: 0.05,
            pinned_to: None,
        }
    }

    /// Places `n` requests one by one from one snapshot, as a burst between
    /// two heartbeats does; returns how many each host got.
    fn burst(hosts: &mut [HostCapacity], n: usize) -> Vec<u32> {
        let request = sandbox();
        let mut counts = vec![0; hosts.len()];
        for _ in 0..n {
            let chosen = place(&request, hosts).unwrap().id.clone();
            let i = hosts.iter().position(|h| h.id == chosen).unwrap();
            reserve(&request, &mut hosts[i]);
            counts[i] += 1;
        }
        counts
    }

    #[test]
    fn a_burst_spreads_over_equal_hosts() {
        let mut hosts = vec![host("a"), host("b"), host("c")];
        let counts = burst(&mut hosts, 100);
        assert_eq!(counts.iter().sum::<u32>(), 100);
        assert!(spread_max_over_mean(&counts) <= 1.2, "{counts:?}");
        assert!(counts.iter().all(|&c| (33..=34).contains(&c)), "{counts:?}");
    }

    #[test]
    fn the_freer_host_takes_more() {
        let mut busy = host("busy");
        busy.cpu_busy = 0.9;
        busy.available_mib = 4_000;
        let mut hosts = vec![busy, host("idle")];
        let counts = burst(&mut hosts, 20);
        assert!(counts[1] > counts[0], "{counts:?}");
        assert_eq!(counts[0] + counts[1], 20);
    }

    #[test]
    fn stale_hosts_are_never_chosen() {
        let mut stale = host("stale");
        stale.live = false;
        stale.available_mib = 23_000;
        let hosts = vec![stale, host("fresh")];
        assert_eq!(place(&sandbox(), &hosts).unwrap().id, "fresh");
        let only_stale = vec![hosts[0].clone()];
        assert_eq!(
            place(&sandbox(), &only_stale),
            Err(PlacementError::NoCapacity)
        );
    }

    #[test]
    fn memory_reserve_and_slots_refuse() {
        let mut tight = host("tight");
        tight.available_mib = 1_024 + 63;
        assert_eq!(
            place(&sandbox(), &[tight.clone()]),
            Err(PlacementError::NoCapacity)
        );
        tight.available_mib = 1_024 + 64;
        assert_eq!(place(&sandbox(), &[tight.clone()]).unwrap().id, "tight");
        // What was placed since the heartbeat counts against the memory.
        reserve(&sandbox(), &mut tight);
        assert_eq!(place(&sandbox(), &[tight]), Err(PlacementError::NoCapacity));

        let mut full = host("full");
        full.max_sandboxes = Some(3);
        full.sandboxes = 2;
        assert!(place(&sandbox(), &[full.clone()]).is_ok());
        full.in_flight.sandboxes = 1;
        assert_eq!(place(&sandbox(), &[full]), Err(PlacementError::NoCapacity));
    }

    #[test]
    fn a_pinned_request_goes_to_its_host_or_nowhere() {
        let mut hosts = vec![host("a"), host("b")];
        hosts[1].available_mib = 2_000;
        let mut pinned = sandbox();
        pinned.pinned_to = Some("b".into());
        assert_eq!(place(&pinned, &hosts).unwrap().id, "b");
        hosts[1].live = false;
        assert_eq!(
            place(&pinned, &hosts),
            Err(PlacementError::PinnedHostUnavailable)
        );
        pinned.pinned_to = Some("gone".into());
        assert_eq!(
            place(&pinned, &hosts),
            Err(PlacementError::PinnedHostUnavailable)
        );
        hosts[1].live = true;
        hosts[1].available_mib = 100;
        pinned.pinned_to = Some("b".into());
        assert_eq!(place(&pinned, &hosts), Err(PlacementError::NoCapacity));
    }

    #[test]
    fn ties_go_to_the_host_holding_fewer() {
        let mut hosts = vec![host("a"), host("b")];
        hosts[0].sandboxes = 5;
        // Same free figures (heartbeats report memory, not counts), so the
        // count decides.
        assert_eq!(place(&sandbox(), &hosts).unwrap().id, "b");
    }

    #[test]
    fn spread_figure() {
        assert_eq!(spread_max_over_mean(&[34, 33, 33]), 34.0 / (100.0 / 3.0));
        assert_eq!(spread_max_over_mean(&[]), 0.0);
        assert_eq!(spread_max_over_mean(&[0, 0]), 0.0);
        assert_eq!(spread_max_over_mean(&[10, 0]), 2.0);
    }
}
