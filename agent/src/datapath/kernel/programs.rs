//! weir's programs: loaded from the embedded object, the cgroup hooks attached once through
//! pinned links, the tc program attached to (and detached from) a pod's interfaces.
use std::{
    fs::File,
    io,
    os::fd::{AsFd, BorrowedFd},
    path::Path,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    programs::{Program, SchedClassifier, SkLookup},
    Ebpf, EbpfLoader,
};
use aya_obj::generated::bpf_attach_type::{
    self, BPF_CGROUP_GETSOCKOPT, BPF_CGROUP_INET4_BIND, BPF_CGROUP_INET4_CONNECT,
    BPF_CGROUP_INET4_GETPEERNAME, BPF_CGROUP_INET6_BIND, BPF_CGROUP_INET6_CONNECT,
    BPF_CGROUP_INET6_GETPEERNAME, BPF_CGROUP_SOCK_OPS, BPF_CGROUP_UDP4_RECVMSG,
    BPF_CGROUP_UDP4_SENDMSG, BPF_CGROUP_UDP6_RECVMSG, BPF_CGROUP_UDP6_SENDMSG,
};
use weir_common::{globals, maps, programs, HANDOFF_SLOTS};

use super::{bpf_sys, netlink::TcProgram};

/// The compiled kernel side, embedded so the agent is one self-contained binary.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("WEIR_EBPF_OBJECT"));

/// The embedded object, parsed, for tests that check what it defines; `None` (a skip, which
/// fails under CI) when the agent was built without one.
#[cfg(test)]
pub(in crate::datapath) fn parsed_object() -> Option<aya_obj::Object> {
    if EBPF_OBJECT.is_empty() {
        let ci = std::env::var("CI");
        assert_ne!(ci.as_deref(), Ok("true"), "built without the eBPF object");
        eprintln!("skipping: built without the eBPF object");
        return None;
    }
    Some(aya_obj::Object::parse(EBPF_OBJECT).expect("the eBPF object parses"))
}

/// The cgroup hooks, each attached once at the root cgroup.
const CGROUP_HOOKS: [(&str, bpf_attach_type); 12] = [
    (programs::CONNECT4, BPF_CGROUP_INET4_CONNECT),
    (programs::CONNECT6, BPF_CGROUP_INET6_CONNECT),
    (programs::SENDMSG4, BPF_CGROUP_UDP4_SENDMSG),
    (programs::SENDMSG6, BPF_CGROUP_UDP6_SENDMSG),
    (programs::RECVMSG4, BPF_CGROUP_UDP4_RECVMSG),
    (programs::RECVMSG6, BPF_CGROUP_UDP6_RECVMSG),
    (programs::GETPEERNAME4, BPF_CGROUP_INET4_GETPEERNAME),
    (programs::GETPEERNAME6, BPF_CGROUP_INET6_GETPEERNAME),
    (programs::BIND4, BPF_CGROUP_INET4_BIND),
    (programs::BIND6, BPF_CGROUP_INET6_BIND),
    (programs::SOCKOPS, BPF_CGROUP_SOCK_OPS),
    (programs::GETSOCKOPT, BPF_CGROUP_GETSOCKOPT),
];

/// Loads weir's object, its maps pinned in (or taken over from) `maps_dir`.
pub(in crate::datapath) fn load(maps_dir: &Path, bpf_log: bool) -> Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    for name in maps::ALL {
        loader.map_pin_path(name, maps_dir.join(name));
    }
    // The object sizes the hand-off for the most CPUs a kernel can have; the kernel allocates a
    // socket hash's buckets up front, so it gets this node's.
    let cpus = aya::util::nr_cpus().map_err(|(what, error)| anyhow!("{what}: {error}"))?;
    loader.map_max_entries(maps::HANDOFF, cpus as u32 * HANDOFF_SLOTS);
    if bpf_log {
        loader.override_global(globals::LOG_ENABLED, &1u8, true);
    }
    if EBPF_OBJECT.is_empty() {
        bail!(
            "this weir-agent was built without its eBPF programs: run `cargo xtask build-ebpf`, \
             then build weir-agent again"
        );
    }
    loader
        .load(EBPF_OBJECT)
        .context("loading weir's eBPF object")
}

/// Attaches every cgroup hook to `cgroup_path` through its pinned link in `links_dir`, and loads
/// the tc program that enrollment attaches to every pod's interfaces. The other tc programs load
/// when a pod first needs one ([`load_tc_programs`]).
pub(in crate::datapath) fn attach(
    ebpf: &mut Ebpf,
    cgroup_path: &Path,
    links_dir: &Path,
) -> Result<()> {
    let cgroup = File::open(cgroup_path)
        .with_context(|| format!("opening cgroup {}", cgroup_path.display()))?;
    for (name, attach_type) in CGROUP_HOOKS {
        let program = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?;
        match program {
            Program::CgroupSockAddr(p) => p.load(),
            Program::SockOps(p) => p.load(),
            Program::CgroupSockopt(p) => p.load(),
            _ => bail!("{name} is not a cgroup program"),
        }
        .with_context(|| format!("loading {name}"))?;
        let program = program.fd().context("program fd")?.as_fd();
        attach_pinned(
            program,
            cgroup.as_fd(),
            attach_type as u32,
            &links_dir.join(name),
        )
        .with_context(|| format!("attaching {name} to {}", cgroup_path.display()))?;
    }
    load_tc_programs(ebpf, &[programs::INBOUND])?;
    handoff(ebpf)?
        .load()
        .context("loading the socket lookup hand-off program")
}

/// The sk_lookup program attached to pods' netns on kernels before 6.5 ([`super::handoff`]).
pub(super) fn handoff(ebpf: &mut Ebpf) -> Result<&mut SkLookup> {
    Ok(ebpf
        .program_mut(programs::HANDOFF)
        .ok_or_else(|| anyhow!("program {} missing", programs::HANDOFF))?
        .try_into()?)
}

fn classifier<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier> {
    Ok(ebpf
        .program_mut(name)
        .ok_or_else(|| anyhow!("program {name} missing"))?
        .try_into()?)
}

/// Loads those of the tc programs `names` not loaded yet. Each costs the verifier's time (the
/// most of an agent's start on older kernels), and most nodes need only the inbound program:
/// the ones for interfaces without an Ethernet header, rerouted interfaces and translated
/// connections wait for a pod that needs them, which a kernel refusing one then fails alone.
pub(in crate::datapath) fn load_tc_programs(ebpf: &mut Ebpf, names: &[&str]) -> Result<()> {
    for name in names {
        let program = classifier(ebpf, name)?;
        if program.fd().is_err() {
            program.load().with_context(|| format!("loading {name}"))?;
        }
    }
    Ok(())
}

/// The tc programs loaded, as pod setup attaches them ([`load_tc_programs`]).
pub(in crate::datapath) fn loaded_tc_programs(ebpf: &Ebpf) -> Vec<TcProgram<'_>> {
    (programs::TC.iter())
        .filter_map(|name| tc_program(ebpf, name).ok())
        .collect()
}

/// A loaded tc program, as pod setup attaches it: a classic cls_bpf filter
/// over netlink (`netlink::Rtnl::attach_programs`), since a TCX link costs a `synchronize_rcu()`
/// under the rtnl lock per pod (~16 ms), where the qdisc costs an expedited grace period.
pub(in crate::datapath) fn tc_program<'a>(ebpf: &'a Ebpf, name: &'a str) -> Result<TcProgram<'a>> {
    let program: &SchedClassifier = ebpf
        .program(name)
        .ok_or_else(|| anyhow!("program {name} missing"))?
        .try_into()?;
    Ok(TcProgram {
        fd: program.fd()?.as_fd(),
        name,
    })
}

/// Attaches a program to `target` (a cgroup or a netns) through a pinned link, or moves an
/// existing pinned link to it.
pub(super) fn attach_pinned(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
    pin: &Path,
) -> Result<()> {
    match bpf_sys::open_pinned(pin) {
        Ok(link) => bpf_sys::update_link(link.as_fd(), prog).context("BPF_LINK_UPDATE"),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let link =
                bpf_sys::create_link(prog, target, attach_type).context("BPF_LINK_CREATE")?;
            bpf_sys::pin_object(link.as_fd(), pin).context("pinning the link")
        }
        Err(error) => Err(error).context("opening the pinned link"),
    }
}

pub(in crate::datapath) fn take_map<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    ebpf: &mut Ebpf,
    name: &str,
) -> Result<T> {
    let map = ebpf
        .take_map(name)
        .ok_or_else(|| anyhow!("map {name} missing from the object"))?;
    Ok(T::try_from(map)?)
}
