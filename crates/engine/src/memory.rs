//! Guest memory files: sparse copies and the pages a running VM changed.
//!
//! A restored VM maps its memory file privately, so the pages it has written
//! since are exactly the anonymous pages of that mapping, and every other
//! page still equals the file. Capturing its memory is therefore: copy the
//! file (holes stay holes), then overwrite only the changed pages, found in
//! `/proc/<pid>/pagemap` and read from `/proc/<pid>/mem`. The cost scales
//! with what the guest wrote, not with its RAM size.
//!
//! Knows nothing of QEMU beyond "a process that maps this file"; the caller
//! pauses the VM around [`write_changed_pages`].

use crate::error::{IoContext, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const PAGE: u64 = 4096;
const PAGEMAP_PRESENT: u64 = 1 << 63;
const PAGEMAP_FILE_OR_SHARED: u64 = 1 << 61;

/// Creates `dst` as a copy of `src` that keeps `src`'s holes, copying only
/// the data extents (in the kernel, with `copy_file_range`).
pub fn copy_sparse(src: &Path, dst: &Path) -> Result<u64> {
    let input = File::open(src).io_context(|| format!("opening {}", src.display()))?;
    let output = File::create(dst).io_context(|| format!("creating {}", dst.display()))?;
    let len = input
        .metadata()
        .io_context(|| format!("reading size of {}", src.display()))?
        .len();
    output
        .set_len(len)
        .io_context(|| format!("sizing {}", dst.display()))?;
    let mut copied = 0u64;
    let mut offset: i64 = 0;
    while (offset as u64) < len {
        // SAFETY: plain syscalls on descriptors owned by `input`.
        let data = unsafe { libc::lseek(input.as_raw_fd(), offset, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: no data after offset.
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(input.as_raw_fd(), data, libc::SEEK_HOLE) };
        let end = if hole < 0 { len as i64 } else { hole };
        let mut src_off = data;
        let mut dst_off = data;
        while src_off < end {
            // SAFETY: both descriptors are open; the offsets are valid pointers
            // to locals the kernel advances.
            let mut n = unsafe {
                libc::copy_file_range(
                    input.as_raw_fd(),
                    &mut src_off,
                    output.as_raw_fd(),
                    &mut dst_off,
                    (end - src_off) as usize,
                    0,
                )
            };
            if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EXDEV) {
                // Across filesystems (disk to tmpfs) copy_file_range refuses;
                // sendfile copies in the kernel too, at the output's offset.
                // SAFETY: plain syscalls on open descriptors; src_off is a
                // valid local the kernel advances.
                n = unsafe {
                    if libc::lseek(output.as_raw_fd(), dst_off, libc::SEEK_SET) < 0 {
                        -1
                    } else {
                        libc::sendfile(
                            output.as_raw_fd(),
                            input.as_raw_fd(),
                            &mut src_off,
                            (end - src_off) as usize,
                        )
                    }
                };
                if n > 0 {
                    dst_off += n as i64;
                }
            }
            if n < 0 {
                return Err(std::io::Error::last_os_error())
                    .io_context(|| format!("copying {} to {}", src.display(), dst.display()));
            }
            if n == 0 {
                break;
            }
            copied += n as u64;
        }
        offset = end;
    }
    Ok(copied)
}

/// Where a file is mapped in a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub file_offset: u64,
}

/// Finds the mappings of `file` in `/proc/<pid>/maps` (under `proc_root`).
pub fn find_mappings(proc_root: &Path, pid: u32, file: &Path) -> Result<Vec<Mapping>> {
    let maps_path = proc_root.join(pid.to_string()).join("maps");
    let text = std::fs::read_to_string(&maps_path)
        .io_context(|| format!("reading {}", maps_path.display()))?;
    Ok(parse_maps(&text, file))
}

fn parse_maps(text: &str, file: &Path) -> Vec<Mapping> {
    let wanted = file.to_string_lossy();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(6, ' ');
            let range = fields.next()?;
            let _perms = fields.next()?;
            let offset = fields.next()?;
            let _dev = fields.next()?;
            let _inode = fields.next()?;
            let path = fields.next()?.trim_start();
            if path != wanted {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                file_offset: u64::from_str_radix(offset, 16).ok()?,
            })
        })
        .collect()
}

/// Runs of changed pages: (file offset, length in bytes, address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedRun {
    pub file_offset: u64,
    pub len: u64,
    pub address: u64,
}

/// The pages of `mappings` that the process has written (anonymous pages of
/// a private file mapping), merged into runs.
pub fn changed_runs(proc_root: &Path, pid: u32, mappings: &[Mapping]) -> Result<Vec<ChangedRun>> {
    let pagemap_path = proc_root.join(pid.to_string()).join("pagemap");
    let pagemap =
        File::open(&pagemap_path).io_context(|| format!("opening {}", pagemap_path.display()))?;
    let mut runs: Vec<ChangedRun> = Vec::new();
    for mapping in mappings {
        let pages = (mapping.end - mapping.start) / PAGE;
        let mut entries = vec![0u8; (pages * 8) as usize];
        pagemap
            .read_exact_at(&mut entries, mapping.start / PAGE * 8)
            .io_context(|| format!("reading {}", pagemap_path.display()))?;
        for (index, chunk) in entries.chunks_exact(8).enumerate() {
            let entry = u64::from_le_bytes(chunk.try_into().unwrap());
            if entry & PAGEMAP_PRESENT == 0 || entry & PAGEMAP_FILE_OR_SHARED != 0 {
                continue;
            }
            let address = mapping.start + index as u64 * PAGE;
            let file_offset = mapping.file_offset + index as u64 * PAGE;
            match runs.last_mut() {
                Some(run) if run.address + run.len == address => run.len += PAGE,
                _ => runs.push(ChangedRun {
                    file_offset,
                    len: PAGE,
                    address,
                }),
            }
        }
    }
    Ok(runs)
}

/// Copies the changed runs from the process's memory into `dst` at their
/// file offsets. Returns the bytes written.
pub fn write_changed_pages(
    proc_root: &Path,
    pid: u32,
    runs: &[ChangedRun],
    dst: &Path,
) -> Result<u64> {
    let mem_path: PathBuf = proc_root.join(pid.to_string()).join("mem");
    let mem = File::open(&mem_path).io_context(|| format!("opening {}", mem_path.display()))?;
    let out = std::fs::OpenOptions::new()
        .write(true)
        .open(dst)
        .io_context(|| format!("opening {}", dst.display()))?;
    let mut buffer = vec![0u8; 1 << 20];
    let mut written = 0;
    for run in runs {
        let mut done = 0;
        while done < run.len {
            let n = (run.len - done).min(buffer.len() as u64) as usize;
            mem.read_exact_at(&mut buffer[..n], run.address + done)
                .io_context(|| format!("reading guest memory of process {pid}"))?;
            out.write_all_at(&buffer[..n], run.file_offset + done)
                .io_context(|| format!("writing {}", dst.display()))?;
            done += n as u64;
        }
        written += run.len;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_select_the_memory_file() {
        let text = "7f0000000000-7f0080000000 rw-p 00000000 fe:01 1234                       /var/lib/shoal/t/memory\n\
                    7f0080000000-7f0080001000 r--p 00000000 fe:01 99                         /usr/lib/libc.so.6\n";
        let maps = parse_maps(text, Path::new("/var/lib/shoal/t/memory"));
        assert_eq!(
            maps,
            vec![Mapping {
                start: 0x7f0000000000,
                end: 0x7f0080000000,
                file_offset: 0
            }]
        );
    }

    #[test]
    fn changed_pages_of_a_private_mapping_are_found_and_copied() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("shoal-mem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let backing = dir.join("backing");
        let mut content = vec![0u8; 16 * PAGE as usize];
        content[..PAGE as usize].fill(1);
        std::fs::write(&backing, &content).unwrap();
        let file = File::open(&backing).unwrap();
        // SAFETY: a fresh private mapping of a file we own, unmapped below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                content.len(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        } as *mut u8;
        assert_ne!(ptr as isize, -1);
        // SAFETY: reads and writes stay inside the 16-page mapping.
        unsafe {
            let _ = std::ptr::read_volatile(ptr); // present, unchanged: not copied
            *ptr.add(3 * PAGE as usize) = 7;
            *ptr.add(4 * PAGE as usize) = 8;
            *ptr.add(9 * PAGE as usize) = 9;
        }
        let pid = std::process::id();
        let maps = find_mappings(Path::new("/proc"), pid, &backing).unwrap();
        let runs = changed_runs(Path::new("/proc"), pid, &maps).unwrap();
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert_eq!((runs[0].file_offset, runs[0].len), (3 * PAGE, 2 * PAGE));
        assert_eq!((runs[1].file_offset, runs[1].len), (9 * PAGE, PAGE));
        let copy = dir.join("copy");
        copy_sparse(&backing, &copy).unwrap();
        write_changed_pages(Path::new("/proc"), pid, &runs, &copy).unwrap();
        let copied = std::fs::read(&copy).unwrap();
        assert_eq!(copied[0], 1);
        assert_eq!(copied[3 * PAGE as usize], 7);
        assert_eq!(copied[4 * PAGE as usize], 8);
        assert_eq!(copied[9 * PAGE as usize], 9);
        assert_eq!(
            std::fs::read(&backing).unwrap(),
            content,
            "backing file untouched"
        );
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(ptr as *mut libc::c_void, content.len()) };
        // Holes survive the copy.
        let sparse = dir.join("sparse");
        let f = File::create(&sparse).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"x", 32 << 20).unwrap();
        let sparse_copy = dir.join("sparse-copy");
        copy_sparse(&sparse, &sparse_copy).unwrap();
        let meta = std::fs::metadata(&sparse_copy).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(meta.blocks() * 512 < 1 << 20, "copy stayed sparse");
        assert_eq!(std::fs::read(&sparse_copy).unwrap()[32 << 20], b'x');
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
