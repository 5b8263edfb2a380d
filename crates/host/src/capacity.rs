//! The capacity gate: slots for sandboxes held in memory, the host's
//! available memory, the memory the VMs already placed may still take
//! (each up to its cgroup's limit), and free space on the engine's state
//! disk (where VM disk layers, snapshots and hibernated memory are
//! written). All are checked before anything is made, so a refusal means
//! nothing exists and the client may retry.
//!
//! Committed memory: an idle clone holds ~25 MiB of its template's RAM, so
//! a host commits more than it has (`overcommit` times its memory less the
//! reserve). What the ratio bounds is the burst: creates that each see
//! `MemAvailable` fine before any of them has grown.
//!
//! A refusal is about VMs that exist: a create that would fit beside the
//! placed VMs but not beside other creates still in flight waits (up to
//! [`PENDING_WAIT`]) for those to finish or fail, so a burst of creates the
//! quota will mostly refuse gets its 429s, not 503s.

use crate::{HostError, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// The longest a create waits for in-flight creates before a refusal.
pub const PENDING_WAIT: Duration = Duration::from_secs(10);

pub struct Capacity {
    max_sandboxes: Option<usize>,
    reserve_mib: u64,
    /// Memory limits of VMs may add up to this times (total − reserve).
    overcommit: f64,
    /// `MemTotal`, read once.
    total_mib: Option<u64>,
    /// The engine's state directory, whose file system is measured.
    state_dir: PathBuf,
    /// Space (MiB) kept free on that file system.
    disk_reserve_mib: u64,
    /// Slots and memory limits (MiB) promised to creates still in flight.
    pending: Arc<Mutex<Pending>>,
}

#[derive(Debug, Default)]
struct Pending {
    slots: usize,
    memory_mib: u64,
    /// Woken when a reservation is released.
    released: Arc<Notify>,
}

/// What the VMs on the host hold now (hibernated ones hold nothing).
#[derive(Debug, Clone, Copy, Default)]
pub struct Held {
    pub sandboxes: usize,
    /// The sum of their cgroups' memory limits.
    pub memory_mib: u64,
}

/// Slots held for sandboxes being made; released when dropped (by then the
/// sandboxes exist and are counted by the engine, or failed).
pub struct Reservation {
    count: usize,
    memory_mib: u64,
    pending: Arc<Mutex<Pending>>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut pending = self.pending.lock().unwrap();
        pending.slots -= self.count;
        pending.memory_mib -= self.memory_mib;
        pending.released.notify_waiters();
    }
}

/// The default [`Capacity`] overcommit ratio.
pub const DEFAULT_MEMORY_OVERCOMMIT: f64 = 8.0;

impl Capacity {
    pub fn new(max_sandboxes: Option<usize>, reserve_mib: u64) -> Self {
        Capacity {
            max_sandboxes,
            reserve_mib,
            overcommit: DEFAULT_MEMORY_OVERCOMMIT,
            total_mib: meminfo_mib("MemTotal:"),
            state_dir: PathBuf::new(),
            disk_reserve_mib: 0,
            pending: Arc::default(),
        }
    }

    /// The same gate with memory limits adding up to at most `ratio` times
    /// the host's memory less the reserve (0: no such limit).
    /// The most sandboxes it holds, and the memory it keeps for the host.
    pub fn limits(&self) -> (Option<usize>, u64) {
        (self.max_sandboxes, self.reserve_mib)
    }

    pub fn with_overcommit(mut self, ratio: f64) -> Self {
        self.overcommit = ratio;
        self
    }

    /// The same gate, also refusing while the file system of `state_dir`
    /// has less than `reserve_mib` MiB free.
    pub fn with_disk_reserve(mut self, state_dir: &Path, reserve_mib: u64) -> Self {
        self.state_dir = state_dir.to_owned();
        self.disk_reserve_mib = reserve_mib;
        self
    }

    /// Refuses with [`HostError::DiskShort`] while the state disk has less
    /// than the reserve free: before a create, a fork, a wake, a snapshot
    /// or a hibernation, each of which writes there.
    pub fn check_disk(&self) -> Result<()> {
        if self.disk_reserve_mib == 0 {
            return Ok(());
        }
        // A state dir not made yet is measured at its nearest parent.
        let dir = self
            .state_dir
            .ancestors()
            .find(|d| d.exists())
            .unwrap_or(Path::new("/"));
        let stat = nix::sys::statvfs::statvfs(dir).map_err(|e| {
            HostError::Invalid(format!("reading free space of {}: {e}", dir.display()))
        })?;
        let available_mib =
            (stat.blocks_available() as u64).saturating_mul(stat.fragment_size() as u64) >> 20;
        if available_mib < self.disk_reserve_mib {
            return Err(HostError::DiskShort {
                available_mib,
                reserve_mib: self.disk_reserve_mib,
            });
        }
        Ok(())
    }

    /// `held` is in memory now; take `count` more slots for VMs whose
    /// cgroups allow `memory_mib` each.
    pub fn reserve(&self, held: Held, count: usize, memory_mib: u64) -> Result<Reservation> {
        self.try_reserve(held, count, memory_mib)
            .map_err(|r| r.error)
    }

    /// What wakes a create waiting on in-flight ones (see [`Refusal`]).
    pub fn released(&self) -> Arc<Notify> {
        self.pending.lock().unwrap().released.clone()
    }

    /// [`Capacity::reserve`], saying whether the refusal is only for
    /// creates still in flight.
    pub fn try_reserve(
        &self,
        held: Held,
        count: usize,
        memory_mib: u64,
    ) -> std::result::Result<Reservation, Refusal> {
        let now = |error| Refusal {
            error,
            in_flight_only: false,
        };
        self.check_disk().map_err(now)?;
        let available_mib = meminfo_mib("MemAvailable:");
        if available_mib.is_some_and(|a| a < self.reserve_mib) {
            return Err(now(HostError::MemoryShort {
                available_mib: available_mib.unwrap_or(0),
                reserve_mib: self.reserve_mib,
            }));
        }
        let mut pending = self.pending.lock().unwrap();
        if let Some(max) = self.max_sandboxes {
            if held.sandboxes + pending.slots + count > max {
                return Err(Refusal {
                    error: HostError::Full,
                    in_flight_only: held.sandboxes + count <= max,
                });
            }
        }
        let wanted_mib = memory_mib.saturating_mul(count as u64);
        if let (Some(total), true) = (self.total_mib, self.overcommit > 0.0) {
            let limit_mib =
                (total.saturating_sub(self.reserve_mib) as f64 * self.overcommit) as u64;
            let committed_mib = held.memory_mib + pending.memory_mib;
            if committed_mib + wanted_mib > limit_mib {
                return Err(Refusal {
                    error: HostError::Overcommitted {
                        committed_mib,
                        wanted_mib,
                        limit_mib,
                    },
                    in_flight_only: held.memory_mib + wanted_mib <= limit_mib,
                });
            }
        }
        pending.slots += count;
        pending.memory_mib += wanted_mib;
        Ok(Reservation {
            count,
            memory_mib: wanted_mib,
            pending: self.pending.clone(),
        })
    }
}

/// Why [`Capacity::try_reserve`] refused.
pub struct Refusal {
    pub error: HostError,
    /// The placed VMs leave room: only creates in flight are in the way.
    pub in_flight_only: bool,
}

/// A field of /proc/meminfo (`"MemAvailable:"`), in MiB.
pub fn meminfo_mib(field: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_held_until_the_reservation_drops() {
        let capacity = Capacity::new(Some(2), 0);
        let first = capacity.reserve(held(0, 0), 2, 512).unwrap();
        assert!(matches!(
            capacity.reserve(held(0, 0), 1, 512),
            Err(HostError::Full)
        ));
        drop(first);
        assert!(capacity.reserve(held(1, 512), 1, 512).is_ok());
        assert!(matches!(
            capacity.reserve(held(2, 1024), 1, 512),
            Err(HostError::Full)
        ));
    }

    #[test]
    fn a_state_disk_below_its_reserve_refuses() {
        let dir = std::env::temp_dir();
        let capacity = Capacity::new(None, 0).with_disk_reserve(&dir, u64::MAX >> 21);
        assert!(matches!(
            capacity.reserve(held(0, 0), 1, 0),
            Err(HostError::DiskShort { .. })
        ));
        assert!(matches!(
            capacity.check_disk(),
            Err(HostError::DiskShort { .. })
        ));
        // A missing state dir is measured at its parent.
        let missing = dir.join("shoal-capacity-no-such-dir/state");
        let capacity = Capacity::new(None, 0).with_disk_reserve(&missing, 1);
        assert!(capacity.reserve(held(0, 0), 1, 0).is_ok());
    }

    #[test]
    fn a_host_short_of_memory_refuses() {
        let capacity = Capacity::new(None, u64::MAX);
        assert!(matches!(
            capacity.reserve(held(0, 0), 1, 0),
            Err(HostError::MemoryShort { .. })
        ));
    }

    #[test]
    fn committed_memory_counts_placed_and_pending_vms() {
        let mut capacity = Capacity::new(None, 1024).with_overcommit(2.0);
        capacity.total_mib = Some(9 * 1024);
        // (9 GiB - 1 GiB) x 2 = 16 GiB of limits.
        let limit = 16 * 1024;
        assert!(capacity.reserve(held(0, 0), 1, limit).is_ok());
        let placed = held(3, 12 * 1024);
        let pending = capacity.reserve(placed, 1, 3 * 1024).unwrap();
        match capacity.reserve(placed, 1, 2 * 1024) {
            Err(HostError::Overcommitted {
                committed_mib,
                wanted_mib,
                limit_mib,
            }) => assert_eq!(
                (committed_mib, wanted_mib, limit_mib),
                (15 * 1024, 2 * 1024, limit)
            ),
            other => panic!("{:?}", other.err()),
        }
        drop(pending);
        assert!(capacity.reserve(placed, 2, 2 * 1024).is_ok());
        // Ratio 0: no limit.
        let mut unlimited = Capacity::new(None, 0).with_overcommit(0.0);
        unlimited.total_mib = Some(1);
        assert!(unlimited.reserve(held(100, 1 << 30), 1, 1 << 20).is_ok());
    }

    #[test]
    fn a_refusal_only_for_creates_in_flight_says_so_and_wakes_on_release() {
        let mut capacity = Capacity::new(Some(3), 0).with_overcommit(1.0);
        capacity.total_mib = Some(10 * 1024);
        let in_flight = capacity.reserve(held(0, 0), 1, 6 * 1024).unwrap();
        // Memory: the placed VMs leave room, the create in flight does not.
        let refusal = capacity.try_reserve(held(0, 0), 1, 6 * 1024).err().unwrap();
        assert!(refusal.in_flight_only);
        assert!(matches!(refusal.error, HostError::Overcommitted { .. }));
        // Placed VMs alone are over: no waiting.
        let refusal = capacity
            .try_reserve(held(1, 6 * 1024), 1, 6 * 1024)
            .err()
            .unwrap();
        assert!(!refusal.in_flight_only);
        // Slots likewise.
        let two = capacity.reserve(held(0, 0), 2, 1).unwrap();
        let refusal = capacity.try_reserve(held(0, 0), 1, 1).err().unwrap();
        assert!(matches!(refusal.error, HostError::Full) && refusal.in_flight_only);
        let refusal = capacity.try_reserve(held(3, 3), 1, 1).err().unwrap();
        assert!(!refusal.in_flight_only);
        drop(two);

        let released = capacity.released();
        let woken = released.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        drop(in_flight);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime
            .block_on(async { tokio::time::timeout(Duration::from_secs(1), woken).await })
            .expect("a release wakes waiters");
        assert!(capacity.reserve(held(0, 0), 1, 6 * 1024).is_ok());
    }

    fn held(sandboxes: usize, memory_mib: u64) -> Held {
        Held {
            sandboxes,
            memory_mib,
        }
    }
}
