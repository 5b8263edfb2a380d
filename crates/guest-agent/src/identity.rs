//! Gives a restored or cloned guest its own identity: hostname, wall clock,
//! and fresh entropy with a forced CRNG reseed, so two clones of one
//! snapshot never share `/dev/urandom` output.
//!
//! Does not own: choosing the identity; the host sends it.

use crate::errors::CallError;
use shoal_proto::ErrorKind;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// `_IOW('R', 0x03, int[2])` from <linux/random.h>.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)` from <linux/random.h> (Linux 4.17+).
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

const MAX_HOSTNAME: usize = 64;

pub fn apply(hostname: &str, unix_time_ns: u64, entropy: &[u8]) -> Result<(), CallError> {
    check_hostname(hostname)?;
    nix::unistd::sethostname(hostname)
        .map_err(|e| CallError::io(&io::Error::from_raw_os_error(e as i32), "sethostname"))?;
    set_clock(unix_time_ns)?;
    add_entropy(entropy)
}

pub fn check_hostname(hostname: &str) -> Result<(), CallError> {
    let valid = !hostname.is_empty()
        && hostname.len() <= MAX_HOSTNAME
        && hostname
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if valid {
        Ok(())
    } else {
        Err(CallError::new(
            ErrorKind::InvalidInput,
            format!("invalid hostname: {hostname:?}"),
        ))
    }
}

fn set_clock(unix_time_ns: u64) -> Result<(), CallError> {
    let now = libc::timespec {
        tv_sec: (unix_time_ns / 1_000_000_000) as _, // time_t: 64-bit on x86_64 glibc and musl
        tv_nsec: (unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: reads a timespec from a valid local.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &now) } < 0 {
        return Err(CallError::io(&io::Error::last_os_error(), "clock_settime"));
    }
    Ok(())
}

/// `/dev/urandom`, opened at start, so it is open in every snapshot: a
/// restore's identity call then skips the path walk and the device open,
/// code each clone would otherwise translate afresh under TCG.
static URANDOM: OnceLock<File> = OnceLock::new();

/// Opens what `apply` needs ahead of time. Without it `apply` opens it then.
pub fn prepare() {
    if let Ok(file) = OpenOptions::new().write(true).open("/dev/urandom") {
        let _ = URANDOM.set(file);
    }
}

/// Mixes `entropy` into the kernel pool, credited in full, then reseeds.
fn add_entropy(entropy: &[u8]) -> Result<(), CallError> {
    let opened;
    let urandom = match URANDOM.get() {
        Some(file) => file,
        None => {
            opened = OpenOptions::new()
                .write(true)
                .open("/dev/urandom")
                .map_err(|e| CallError::io(&e, "/dev/urandom"))?;
            &opened
        }
    };
    if !entropy.is_empty() {
        // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
        // built in u32 words so the buffer is aligned for the kernel.
        let words = 2 + entropy.len().div_ceil(4);
        let mut info = vec![0u32; words];
        info[0] = (entropy.len() * 8) as u32;
        info[1] = entropy.len() as u32;
        let bytes: &mut [u8] = bytemuck_bytes(&mut info[2..]);
        bytes[..entropy.len()].copy_from_slice(entropy);
        // SAFETY: info is a valid rand_pool_info of buf_size bytes of data.
        let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
        if rc < 0 {
            return Err(CallError::io(&io::Error::last_os_error(), "RNDADDENTROPY"));
        }
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG as _) };
    if rc < 0 {
        return Err(CallError::io(&io::Error::last_os_error(), "RNDRESEEDCRNG"));
    }
    Ok(())
}

fn bytemuck_bytes(words: &mut [u32]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: u8 has no alignment or validity requirements and the slice
    // covers exactly the words' memory, borrowed mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostnames_are_checked() {
        assert!(check_hostname("sbx-1.local").is_ok());
        assert!(check_hostname("").is_err());
        assert!(check_hostname("bad name").is_err());
        assert!(check_hostname(&"a".repeat(65)).is_err());
    }
}
