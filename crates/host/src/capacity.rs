//! The capacity gate: slots for sandboxes held in memory, the host's
//! available memory, and free space on the engine's state disk (where VM
//! disk layers, snapshots and hibernated memory are written). All are
//! checked before anything is made, so a refusal means nothing exists and
//! the client may retry.

use crate::{HostError, Result};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub struct Capacity {
    max_sandboxes: Option<usize>,
    reserve_mib: u64,
    /// The engine's state directory, whose file system is measured.
    state_dir: PathBuf,
    /// Space (MiB) kept free on that file system.
    disk_reserve_mib: u64,
    /// Slots promised to creates still in flight.
    pending: Arc<Mutex<usize>>,
}

/// Slots held for sandboxes being made; released when dropped (by then the
/// sandboxes exist and are counted by the engine, or failed).
pub struct Reservation {
    count: usize,
    pending: Arc<Mutex<usize>>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        *self.pending.lock().unwrap() -= self.count;
    }
}

impl Capacity {
    pub fn new(max_sandboxes: Option<usize>, reserve_mib: u64) -> Self {
        Capacity {
            max_sandboxes,
            reserve_mib,
            state_dir: PathBuf::new(),
            disk_reserve_mib: 0,
            pending: Arc::default(),
        }
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

    /// `held` sandboxes are in memory now; take `count` more slots.
    pub fn reserve(&self, held: usize, count: usize) -> Result<Reservation> {
        self.check_disk()?;
        let available_mib = available_memory_mib();
        if available_mib.is_some_and(|a| a < self.reserve_mib) {
            return Err(HostError::MemoryShort {
                available_mib: available_mib.unwrap_or(0),
                reserve_mib: self.reserve_mib,
            });
        }
        let mut pending = self.pending.lock().unwrap();
        if let Some(max) = self.max_sandboxes {
            if held + *pending + count > max {
                return Err(HostError::Full);
            }
        }
        *pending += count;
        Ok(Reservation {
            count,
            pending: self.pending.clone(),
        })
    }
}

/// `MemAvailable` from /proc/meminfo, in MiB.
fn available_memory_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_held_until_the_reservation_drops() {
        let capacity = Capacity::new(Some(2), 0);
        let first = capacity.reserve(0, 2).unwrap();
        assert!(matches!(capacity.reserve(0, 1), Err(HostError::Full)));
        drop(first);
        assert!(capacity.reserve(1, 1).is_ok());
        assert!(matches!(capacity.reserve(2, 1), Err(HostError::Full)));
    }

    #[test]
    fn a_state_disk_below_its_reserve_refuses() {
        let dir = std::env::temp_dir();
        let capacity = Capacity::new(None, 0).with_disk_reserve(&dir, u64::MAX >> 21);
        assert!(matches!(
            capacity.reserve(0, 1),
            Err(HostError::DiskShort { .. })
        ));
        assert!(matches!(
            capacity.check_disk(),
            Err(HostError::DiskShort { .. })
        ));
        // A missing state dir is measured at its parent.
        let missing = dir.join("shoal-capacity-no-such-dir/state");
        let capacity = Capacity::new(None, 0).with_disk_reserve(&missing, 1);
        assert!(capacity.reserve(0, 1).is_ok());
    }

    #[test]
    fn a_host_short_of_memory_refuses() {
        let capacity = Capacity::new(None, u64::MAX);
        assert!(matches!(
            capacity.reserve(0, 1),
            Err(HostError::MemoryShort { .. })
        ));
    }
}
