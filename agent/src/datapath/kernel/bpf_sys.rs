//! The bpf syscalls weir needs and aya 0.14 does not offer.
//!
//! - cgroup bpf_links that outlive the agent and move to a new program on upgrade. aya 0.14 has
//!   no public `BPF_LINK_UPDATE` for cgroup links (and no way to reach a pinned link's fd), and
//!   cannot turn a cgroup sockopt link into a pinnable `FdLink`, so weir makes all of its cgroup
//!   links the same way: `BPF_LINK_CREATE`, pinned with `BPF_OBJ_PIN`, reopened with
//!   `BPF_OBJ_GET`, and moved with `BPF_LINK_UPDATE`, which swaps the program atomically: there
//!   is never a moment with no program attached.
//! - Raw key access to a pinned map of another layout version (whose value type this build does
//!   not know, and aya's typed maps check), to retire it once its pods are migrated.
//! - A hash of maps made from an inner map the agent chose (aya makes the inner map from the
//!   object's BTF, and offers no way to make one from a given map).
//! - A read-only fd on a pinned map (aya's `MapData::from_pin` asks for a read-write one), for
//!   `weir-agent pods` looking at a running agent's maps.
use std::{
    ffi::CString,
    io,
    mem::size_of,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
/// `BPF_OBJ_GET` file flag: the fd reads the map, and the kernel refuses writes through it.
const BPF_F_RDONLY: u32 = 1 << 3;
const BPF_MAP_TYPE_HASH_OF_MAPS: u32 = 13;
/// `BPF_MAP_CREATE` flag: entries are allocated as they are added, not all up front.
pub const BPF_F_NO_PREALLOC: u32 = 1;

#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct MapKeyAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    next_key: u64,
    flags: u64,
}

#[repr(C)]
#[derive(Default)]
struct LinkUpdateAttr {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a properly laid out prefix of `union bpf_attr` for `cmd`; the kernel
    // zero-extends the rest.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn owned(fd: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this descriptor to us.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

/// Makes a hash of maps named `name` (at most 15 bytes) whose values are maps like `inner`.
pub fn create_hash_of_maps(
    name: &str,
    key_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner: BorrowedFd<'_>,
) -> io::Result<OwnedFd> {
    let mut map_name = [0u8; 16];
    if name.len() >= map_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("map name {name:?} is longer than 15 bytes"),
        ));
    }
    map_name[..name.len()].copy_from_slice(name.as_bytes());
    let mut attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_HASH_OF_MAPS,
        key_size,
        value_size: size_of::<u32>() as u32,
        max_entries,
        map_flags,
        inner_map_fd: inner.as_raw_fd() as u32,
        numa_node: 0,
        map_name,
    };
    bpf(BPF_MAP_CREATE, &mut attr).map(owned)
}

/// Attaches `prog` to `target` (a cgroup, or a netns for sk_lookup) with a bpf_link (flags 0:
/// links coexist with other programs).
pub fn create_link(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: target.as_raw_fd() as u32,
        attach_type,
        flags: 0,
    };
    bpf(BPF_LINK_CREATE, &mut attr).map(owned)
}

fn path_cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

pub fn pin_object(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = path_cstring(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

pub fn open_pinned(path: &Path) -> io::Result<OwnedFd> {
    obj_get(path, 0)
}

/// Opens a pinned map for reading only, for a tool that looks at a running agent's maps.
pub fn open_pinned_read_only(path: &Path) -> io::Result<OwnedFd> {
    obj_get(path, BPF_F_RDONLY)
}

fn obj_get(path: &Path, file_flags: u32) -> io::Result<OwnedFd> {
    let path = path_cstring(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        file_flags,
        ..Default::default()
    };
    bpf(BPF_OBJ_GET, &mut attr).map(owned)
}

/// Points an existing link at a new program, atomically.
pub fn update_link(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkUpdateAttr {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        ..Default::default()
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// Deletes `key` from the map; a missing key is not an error.
pub fn map_delete(map: BorrowedFd<'_>, key: &[u8]) -> io::Result<()> {
    let mut attr = MapKeyAttr {
        map_fd: map.as_raw_fd() as u32,
        key: key.as_ptr() as u64,
        ..Default::default()
    };
    match bpf(BPF_MAP_DELETE_ELEM, &mut attr) {
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map(drop),
    }
}

/// Whether a hash map with keys of `key_size` bytes has no entry left.
pub fn map_is_empty(map: BorrowedFd<'_>, key_size: usize) -> io::Result<bool> {
    Ok(count_keys(map, key_size, 1)? == 0)
}

/// The keys of a hash-like map with keys of `key_size` bytes, counted up to `at_most`.
pub fn count_keys(map: BorrowedFd<'_>, key_size: usize, at_most: u32) -> io::Result<u32> {
    let mut count = 0;
    for_each_key(map, key_size, at_most, |_| count += 1)?;
    Ok(count)
}

/// Calls `visit` with each key of a hash-like map with keys of `key_size` bytes, up to
/// `at_most` of them. Entries removed during the walk can send it back to the first key (the
/// kernel's answer for a key that is gone), so it is a sample bounded by `at_most`, not a
/// snapshot.
pub fn for_each_key(
    map: BorrowedFd<'_>,
    key_size: usize,
    at_most: u32,
    mut visit: impl FnMut(&[u8]),
) -> io::Result<()> {
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    for walked in 0..at_most {
        let mut attr = MapKeyAttr {
            map_fd: map.as_raw_fd() as u32,
            // The first call has no key: the walk starts at the first entry.
            key: if walked == 0 { 0 } else { key.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
            ..Default::default()
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => visit(&next),
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => break,
            Err(error) => return Err(error),
        }
        std::mem::swap(&mut key, &mut next);
    }
    Ok(())
}

/// The value at `key`, `value_len` bytes (for a per-CPU map, every CPU's value, each padded to
/// 8 bytes); `None` when the key is not there (any more).
pub fn map_lookup(
    map: BorrowedFd<'_>,
    key: &[u8],
    value_len: usize,
) -> io::Result<Option<Vec<u8>>> {
    let mut value = vec![0u8; value_len];
    let mut attr = MapKeyAttr {
        map_fd: map.as_raw_fd() as u32,
        key: key.as_ptr() as u64,
        // The value's place in the union.
        next_key: value.as_mut_ptr() as u64,
        ..Default::default()
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(Some(value)),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(error) => Err(error),
    }
}
