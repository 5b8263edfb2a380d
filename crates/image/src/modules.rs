//! Kernel module dependency resolution for the initramfs.
//!
//! Owns: parsing `modules.dep`, computing a load order for a set of wanted
//! modules (dependencies first), and reading `depends=` out of a module's
//! `.modinfo` ELF section so a `modules.dep` can be generated when the
//! package does not ship one (Debian's does not: `depmod` runs in postinst,
//! and the host may not even have kmod). Also a tiny "is this ELF static"
//! check for busybox. Knows nothing about where modules come from.

use std::collections::{BTreeMap, HashSet};

use crate::error::ImageError;

/// Canonical module name: what `modprobe` would accept, with `-` and `_`
/// unified (the file `virtio-rng.ko` holds module `virtio_rng`).
pub fn canonical_name(name_or_path: &str) -> String {
    let file = name_or_path.rsplit('/').next().unwrap_or(name_or_path);
    let stem = [".ko.xz", ".ko.zst", ".ko.gz", ".ko"]
        .iter()
        .find_map(|ext| file.strip_suffix(ext))
        .unwrap_or(file);
    stem.replace('-', "_")
}

/// A parsed `modules.dep`: module path (relative to the modules dir) to the
/// paths it depends on, in file order.
#[derive(Debug, Default, Clone)]
pub struct ModulesDep {
    deps: BTreeMap<String, Vec<String>>,
    by_name: BTreeMap<String, String>,
}

impl ModulesDep {
    /// Parses the `path: dep dep...` format written by depmod (and by
    /// [`ModulesDep::to_text`]).
    pub fn parse(text: &str) -> Result<Self, ImageError> {
        let mut dep = ModulesDep::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (path, rest) = line.split_once(':').ok_or_else(|| {
                ImageError::Module(format!("modules.dep line {}: no ':' in {line:?}", n + 1))
            })?;
            dep.insert(
                path.trim().to_string(),
                rest.split_whitespace().map(str::to_string).collect(),
            );
        }
        Ok(dep)
    }

    /// Adds one module and its dependency paths.
    pub fn insert(&mut self, path: String, deps: Vec<String>) {
        self.by_name.insert(canonical_name(&path), path.clone());
        self.deps.insert(path, deps);
    }

    /// The path of the module called `name`, if it is a loadable module.
    pub fn path_of(&self, name: &str) -> Option<&str> {
        self.by_name.get(&canonical_name(name)).map(String::as_str)
    }

    /// Renders in depmod's format (sorted, so the output is reproducible).
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (path, deps) in &self.deps {
            s.push_str(path);
            s.push(':');
            for d in deps {
                s.push(' ');
                s.push_str(d);
            }
            s.push('\n');
        }
        s
    }

    /// Paths of `wanted` modules plus everything they depend on, ordered so
    /// that every module comes after all of its dependencies (the order
    /// `insmod` needs). The order is deterministic: wanted modules in the
    /// order given, each preceded by its not-yet-listed dependencies in
    /// modules.dep order. Names in `builtin` are skipped silently; a name
    /// that is neither loadable nor built in is an error.
    pub fn load_order(
        &self,
        wanted: &[&str],
        builtin: &HashSet<String>,
    ) -> Result<Vec<String>, ImageError> {
        let mut order = Vec::new();
        let mut done = HashSet::new();
        for name in wanted {
            let canon = canonical_name(name);
            match self.path_of(&canon) {
                Some(path) => {
                    self.visit(path, &mut Vec::new(), &mut done, &mut order)?;
                }
                None if builtin.contains(&canon) => {}
                None => {
                    return Err(ImageError::Module(format!(
                        "{name} is neither a loadable module nor built into the kernel"
                    )))
                }
            }
        }
        Ok(order)
    }

    fn visit(
        &self,
        path: &str,
        stack: &mut Vec<String>,
        done: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) -> Result<(), ImageError> {
        if done.contains(path) {
            return Ok(());
        }
        if stack.iter().any(|p| p == path) {
            return Err(ImageError::Module(format!(
                "dependency cycle: {} -> {path}",
                stack.join(" -> ")
            )));
        }
        let deps = self.deps.get(path).ok_or_else(|| {
            ImageError::Module(format!(
                "{path} is a dependency but has no modules.dep entry"
            ))
        })?;
        stack.push(path.to_string());
        for d in deps {
            self.visit(d, stack, done, order)?;
        }
        stack.pop();
        done.insert(path.to_string());
        order.push(path.to_string());
        Ok(())
    }
}

/// Reads a 64-bit little-endian ELF header field; `None` when out of range.
fn le(bytes: &[u8], at: usize, len: usize) -> Option<u64> {
    let b = bytes.get(at..at + len)?;
    Some(
        b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x)),
    )
}

fn is_elf64_le(bytes: &[u8]) -> bool {
    bytes.len() > 0x40 && bytes.starts_with(b"\x7fELF") && bytes[4] == 2 && bytes[5] == 1
}

/// The `.modinfo` section of an (uncompressed) kernel module: NUL-separated
/// `key=value` strings.
pub fn modinfo(ko: &[u8]) -> Result<Vec<(String, String)>, ImageError> {
    let bad = |what: &str| ImageError::Module(format!("not a valid x86-64 module: {what}"));
    if !is_elf64_le(ko) {
        return Err(bad("no ELF64 little-endian header"));
    }
    let shoff = le(ko, 0x28, 8).ok_or_else(|| bad("e_shoff"))? as usize;
    let shentsize = le(ko, 0x3A, 2).ok_or_else(|| bad("e_shentsize"))? as usize;
    let shnum = le(ko, 0x3C, 2).ok_or_else(|| bad("e_shnum"))? as usize;
    let shstrndx = le(ko, 0x3E, 2).ok_or_else(|| bad("e_shstrndx"))? as usize;
    let section = |i: usize| -> Option<(usize, usize, usize)> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        Some((
            le(ko, h, 4)? as usize,
            le(ko, h + 24, 8)? as usize,
            le(ko, h + 32, 8)? as usize,
        ))
    };
    let (_, str_off, str_size) = section(shstrndx).ok_or_else(|| bad("section names"))?;
    let names = ko
        .get(str_off..str_off.saturating_add(str_size))
        .ok_or_else(|| bad("section names out of range"))?;
    for i in 0..shnum {
        let (name_off, off, size) = section(i).ok_or_else(|| bad("section header"))?;
        let name = names
            .get(name_off..)
            .and_then(|n| n.split(|&b| b == 0).next())
            .unwrap_or_default();
        if name != b".modinfo" {
            continue;
        }
        let data = ko
            .get(off..off.saturating_add(size))
            .ok_or_else(|| bad(".modinfo out of range"))?;
        return Ok(data
            .split(|&b| b == 0)
            .filter_map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                kv.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect());
    }
    Err(bad("no .modinfo section"))
}

/// The module names a module declares in `depends=` (may be empty).
pub fn declared_depends(ko: &[u8]) -> Result<Vec<String>, ImageError> {
    Ok(modinfo(ko)?
        .into_iter()
        .filter(|(k, _)| k == "depends")
        .flat_map(|(_, v)| {
            v.split(',')
                .filter(|s| !s.is_empty())
                .map(canonical_name)
                .collect::<Vec<_>>()
        })
        .collect())
}

/// True when `elf` is an ELF executable without a program interpreter, i.e.
/// it can run in an initramfs that has no libc. (A dynamic busybox from the
/// `busybox` package would fail there with a confusing "not found".)
pub fn is_static_elf(elf: &[u8]) -> bool {
    if !is_elf64_le(elf) {
        return false;
    }
    const PT_INTERP: u64 = 3;
    let (Some(phoff), Some(phentsize), Some(phnum)) =
        (le(elf, 0x20, 8), le(elf, 0x36, 2), le(elf, 0x38, 2))
    else {
        return false;
    };
    (0..phnum).all(|i| {
        let at = (phoff + i * phentsize) as usize;
        le(elf, at, 4).is_some_and(|t| t != PT_INTERP)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
kernel/net/core/failover.ko:
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio_ring.ko kernel/drivers/virtio/virtio.ko
";

    fn pos(order: &[String], name: &str) -> usize {
        order
            .iter()
            .position(|p| canonical_name(p) == name)
            .unwrap_or_else(|| panic!("{name} missing from {order:?}"))
    }

    #[test]
    fn canonical_names_unify_dash_and_strip_extensions() {
        assert_eq!(canonical_name("kernel/x/virtio-rng.ko"), "virtio_rng");
        assert_eq!(canonical_name("virtio_blk.ko.xz"), "virtio_blk");
        assert_eq!(canonical_name("rng-core"), "rng_core");
    }

    #[test]
    fn dependencies_come_first_and_each_module_once() {
        let dep = ModulesDep::parse(DEP).unwrap();
        let builtin: HashSet<String> = ["rng_core".to_string()].into();
        let order = dep
            .load_order(
                &[
                    "virtio_mmio",
                    "virtio_blk",
                    "virtio_rng",
                    "rng_core",
                    "virtio_net",
                ],
                &builtin,
            )
            .unwrap();
        assert_eq!(order.len(), 8, "{order:?}");
        assert!(pos(&order, "virtio_ring") < pos(&order, "virtio_mmio"));
        assert!(pos(&order, "virtio") < pos(&order, "virtio_mmio"));
        assert!(pos(&order, "failover") < pos(&order, "net_failover"));
        assert!(pos(&order, "net_failover") < pos(&order, "virtio_net"));
        assert!(pos(&order, "virtio_mmio") < pos(&order, "virtio_blk"));
        let unique: HashSet<_> = order.iter().collect();
        assert_eq!(unique.len(), order.len());
    }

    #[test]
    fn order_is_deterministic_and_follows_request_order() {
        let dep = ModulesDep::parse(DEP).unwrap();
        let none = HashSet::new();
        let a = dep
            .load_order(&["virtio_blk", "virtio_mmio"], &none)
            .unwrap();
        let b = dep
            .load_order(&["virtio_blk", "virtio_mmio"], &none)
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a.iter().map(|p| canonical_name(p)).collect::<Vec<_>>(),
            ["virtio_ring", "virtio", "virtio_blk", "virtio_mmio"]
        );
    }

    #[test]
    fn unknown_module_is_an_error_but_builtin_is_skipped() {
        let dep = ModulesDep::parse(DEP).unwrap();
        assert!(dep.load_order(&["nope"], &HashSet::new()).is_err());
        let builtin: HashSet<String> = ["nope".to_string()].into();
        assert!(dep.load_order(&["nope"], &builtin).unwrap().is_empty());
    }

    #[test]
    fn cycles_and_dangling_dependencies_are_errors() {
        let cyc = ModulesDep::parse("a.ko: b.ko\nb.ko: a.ko\n").unwrap();
        assert!(cyc.load_order(&["a"], &HashSet::new()).is_err());
        let dangling = ModulesDep::parse("a.ko: missing.ko\n").unwrap();
        assert!(dangling.load_order(&["a"], &HashSet::new()).is_err());
    }

    #[test]
    fn text_round_trips() {
        let dep = ModulesDep::parse(DEP).unwrap();
        let again = ModulesDep::parse(&dep.to_text()).unwrap();
        assert_eq!(dep.to_text(), again.to_text());
    }

    #[test]
    fn host_busybox_is_recognised_as_static_and_sh_is_not() {
        if let Ok(bb) = std::fs::read("/bin/busybox") {
            assert!(is_static_elf(&bb));
        }
        let sh = std::fs::read(std::fs::canonicalize("/bin/sh").unwrap()).unwrap();
        assert!(!is_static_elf(&sh));
        assert!(!is_static_elf(b"#!/bin/sh\n"));
    }
}
