//! The running kernel, as far as weir's choices depend on it: the floor it refuses to run below,
//! the version a kernel-specific path is chosen by, and the BPF program and map types it loads.
use std::{fs, io};

use anyhow::{bail, Context, Result};
use aya::{
    maps::MapType,
    programs::{ProgramError, ProgramType},
};

/// The oldest kernel weir runs on, and what came last of what weir uses.
pub(crate) const OLDEST: (u32, u32) = (5, 10);
pub(crate) const OLDEST_BECAUSE: &str =
    "cgroup getpeername hooks (5.8), sk_lookup (5.9) and socket map updates from tc (5.10)";

pub(crate) struct Kernel {
    pub release: String,
    version: (u32, u32),
}

impl Kernel {
    /// The running kernel, whatever its version.
    pub(crate) fn read() -> Result<Self> {
        let release = fs::read_to_string("/proc/sys/kernel/osrelease")
            .context("reading the kernel release")?
            .trim()
            .to_owned();
        let version = version(&release)
            .with_context(|| format!("kernel release {release:?} has no version"))?;
        Ok(Self { release, version })
    }

    /// The running kernel; an error naming what weir needs when it is older than that.
    pub(in crate::datapath) fn running() -> Result<Self> {
        let kernel = Self::read()?;
        if !kernel.is_supported() {
            bail!(
                "Linux {}: weir needs Linux {}.{} or later, for {OLDEST_BECAUSE}",
                kernel.release,
                OLDEST.0,
                OLDEST.1
            );
        }
        Ok(kernel)
    }

    /// At or above [`OLDEST`].
    pub(crate) fn is_supported(&self) -> bool {
        self.version >= OLDEST
    }

    pub(super) fn is_at_least(&self, major: u32, minor: u32) -> bool {
        self.version >= (major, minor)
    }
}

/// `(major, minor)` of a kernel release such as `6.1.0-50-amd64`.
fn version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

/// A BPF program or map type weir's object holds.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BpfType {
    Program(ProgramType),
    Map(MapType),
}

/// One BPF type the kernel must have, named as the kernel names it.
pub(crate) struct BpfFeature {
    pub kind: BpfType,
    pub name: &'static str,
    /// What weir does with it.
    pub used_for: &'static str,
    /// The kernel build option that brings it.
    pub kconfig: &'static str,
}

const fn program(
    kind: ProgramType,
    name: &'static str,
    used_for: &'static str,
    kconfig: &'static str,
) -> BpfFeature {
    BpfFeature {
        kind: BpfType::Program(kind),
        name,
        used_for,
        kconfig,
    }
}

const fn map(
    kind: MapType,
    name: &'static str,
    used_for: &'static str,
    kconfig: &'static str,
) -> BpfFeature {
    BpfFeature {
        kind: BpfType::Map(kind),
        name,
        used_for,
        kconfig,
    }
}

/// Every program and map type of weir's object (the unit test below holds the object to it).
pub(crate) const BPF_FEATURES: [BpfFeature; 15] = [
    program(
        ProgramType::CgroupSockAddr,
        "cgroup_sock_addr",
        "connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6",
        "CONFIG_CGROUP_BPF",
    ),
    program(
        ProgramType::SockOps,
        "sock_ops",
        "original destinations by connection",
        "CONFIG_CGROUP_BPF",
    ),
    program(
        ProgramType::CgroupSockopt,
        "cgroup_sockopt",
        "getsockopt SO_ORIGINAL_DST",
        "CONFIG_CGROUP_BPF",
    ),
    program(
        ProgramType::SchedClassifier,
        "sched_cls",
        "tc on pods' interfaces",
        "CONFIG_NET_CLS_BPF",
    ),
    program(
        ProgramType::SkLookup,
        "sk_lookup",
        "inbound hand-off to ztunnel",
        "CONFIG_INET",
    ),
    map(
        MapType::Hash,
        "hash",
        "pods, their addresses, sidecar pods' port lists",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::LpmTrie,
        "lpm_trie",
        "sidecar pods' IP range lists",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::PerCpuHash,
        "percpu_hash",
        "pods' counters",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::LruHash,
        "lru_hash",
        "connections' original destinations, rerouted connections' translations",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::HashOfMaps,
        "hash_of_maps",
        "each REDIRECT-mode sidecar pod's translation map",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::Array,
        "array",
        "the node's settings, the trace switch",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::PerCpuArray,
        "percpu_array",
        "trace records lost",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::SkStorage,
        "sk_storage",
        "socket storage: sockets' original destinations",
        "CONFIG_BPF_SYSCALL",
    ),
    map(
        MapType::SockHash,
        "sockhash",
        "inbound hand-off to ztunnel",
        "CONFIG_BPF_STREAM_PARSER",
    ),
    map(
        MapType::RingBuf,
        "ringbuf",
        "decision records for `weir-agent trace`, the programs' log records",
        "CONFIG_BPF_SYSCALL",
    ),
];

impl BpfFeature {
    /// Whether the running kernel has it, from loading a trivial program or creating a small map
    /// of the type; `Err` when the bpf() call failed otherwise (EPERM: not allowed to use bpf()).
    pub(crate) fn probe(&self) -> io::Result<bool> {
        match self.kind {
            BpfType::Program(kind) => {
                aya::sys::is_program_supported(kind).map_err(|error| match error {
                    ProgramError::SyscallError(error) => error.io_error,
                    other => io::Error::other(other),
                })
            }
            BpfType::Map(kind) => aya::sys::is_map_supported(kind).map_err(|error| error.io_error),
        }
    }
}

#[cfg(test)]
mod tests {
    use aya_obj::ProgramSection;

    use super::*;

    #[test]
    fn versions_are_read_from_distribution_releases() {
        assert_eq!(version("6.1.0-50-amd64"), Some((6, 1)));
        assert_eq!(version("5.10.0-32-amd64"), Some((5, 10)));
        assert_eq!(version("6.12.95+deb12-amd64"), Some((6, 12)));
        assert_eq!(version("6.18.0"), Some((6, 18)));
        assert_eq!(version("weird"), None);
        assert!(version("5.4.0-42-generic").unwrap() < OLDEST);
    }

    /// A program or map type added to the object without its row would go unchecked by
    /// `weir-agent check`, and fail at load instead.
    #[test]
    fn every_program_and_map_type_of_the_object_is_a_feature() {
        let Some(object) = super::super::programs::parsed_object() else {
            return;
        };
        let programs = |wanted: ProgramType| {
            BPF_FEATURES
                .iter()
                .any(|f| matches!(f.kind, BpfType::Program(kind) if kind == wanted))
        };
        for (name, program) in &object.programs {
            let kind = match program.section {
                ProgramSection::CgroupSockAddr { .. } => ProgramType::CgroupSockAddr,
                ProgramSection::SockOps => ProgramType::SockOps,
                ProgramSection::CgroupSockopt { .. } => ProgramType::CgroupSockopt,
                ProgramSection::SchedClassifier => ProgramType::SchedClassifier,
                ProgramSection::SkLookup => ProgramType::SkLookup,
                ref other => panic!("program {name} is of a type with no feature row: {other:?}"),
            };
            assert!(
                programs(kind),
                "program {name}: {kind:?} has no feature row"
            );
        }
        for (name, map) in &object.maps {
            let covered = BPF_FEATURES
                .iter()
                .any(|f| matches!(f.kind, BpfType::Map(kind) if kind as u32 == map.map_type()));
            assert!(
                covered,
                "map {name} (type {}) has no feature row",
                map.map_type()
            );
        }
    }
}
