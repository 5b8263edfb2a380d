//! The capacity gate: slots for sandboxes held in memory, and the host's
//! available memory. Both are checked before anything is made, so a refusal
//! means nothing exists and the client may retry.

use crate::{HostError, Result};
use std::sync::{Arc, Mutex};

pub struct Capacity {
    max_sandboxes: Option<usize>,
    reserve_mib: u64,
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
            pending: Arc::default(),
        }
    }

    /// `held` sandboxes are in memory now; take `count` more slots.
    pub fn reserve(&self, held: usize, count: usize) -> Result<Reservation> {
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
    fn a_host_short_of_memory_refuses() {
        let capacity = Capacity::new(None, u64::MAX);
        assert!(matches!(
            capacity.reserve(0, 1),
            Err(HostError::MemoryShort { .. })
        ));
    }
}
