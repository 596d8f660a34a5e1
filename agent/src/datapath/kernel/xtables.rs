//! The legacy iptables tables (`ip_tables`, `ip6_tables`), read and rewritten as iptables-legacy
//! does: through the get/setsockopt interface of a raw socket, a table at a time.
//!
//! The kernel hands a table over as one blob of rules, laid out chain after chain, where a jump
//! is the byte offset of the rule it goes to; a change replaces the whole blob. Removing a chain
//! is therefore: drop its rules and every rule that jumps into it, then move every offset (jumps,
//! the hooks' entry points and policies) to where its rule now is. The counters of the rules
//! that stay are added back, as iptables does, so a change of ours does not reset another
//! agent's (kube-proxy's) counts.
//!
//! Writers take iptables' lock (`/run/xtables.lock`, the node's when the agent's pod mounts it)
//! around a change, as every iptables command does, so a change of another agent's in between
//! is not lost.
//!
//! A table is read only if the netns has it (`/proc/net/ip_tables_names`): asking for another
//! would load its module and create it. Everything here works in the calling thread's netns.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

/// `IPT_SO_SET_REPLACE`/`IPT_SO_GET_INFO` and `IPT_SO_SET_ADD_COUNTERS`/`IPT_SO_GET_ENTRIES`:
/// the same numbers for IPv6 (`IP6T_SO_*`).
const SO_REPLACE_OR_INFO: libc::c_int = 64;
const SO_ADD_COUNTERS_OR_ENTRIES: libc::c_int = 65;
const TABLE_NAME_LEN: usize = 32;
const HOOKS: usize = 5;
/// The built-in chains, by hook number (`NF_INET_PRE_ROUTING` ...).
const BUILTIN_CHAINS: [&str; HOOKS] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
/// `struct ipt_getinfo`: name, valid hooks, entry points, policies, entry count, size.
const INFO_LEN: usize = TABLE_NAME_LEN + 4 + 2 * 4 * HOOKS + 4 + 4;
/// `struct ipt_get_entries`' header: name, size, then the rules at 8-byte alignment.
const ENTRIES_HEADER_LEN: usize = 40;
/// `struct ipt_replace`'s header: name, valid hooks, entry count, size, entry points, policies,
/// counter count, then a pointer to the old counters (8-byte aligned).
const REPLACE_HEADER_LEN: usize = 96;
const REPLACE_COUNTERS_POINTER: usize = 88;
/// `struct xt_counters_info`'s header: name, count, then the counters at 8-byte alignment.
const COUNTERS_HEADER_LEN: usize = 40;
/// `struct xt_counters`: packets and bytes.
const COUNTER_LEN: usize = 16;
/// In `struct xt_entry_target`: the target's name, and where its data starts (a standard
/// target's verdict, an error target's chain name).
const TARGET_NAME: std::ops::Range<usize> = 2..31;
const TARGET_DATA: usize = 32;
/// The error target: a user chain's head (its data the chain's name), or the table's end.
const ERROR_TARGET: &[u8] = b"ERROR";
/// How often a change is tried again when another writer changed the table in between.
const REPLACE_TRIES: u32 = 5;
/// iptables' lock, and how long a change waits for it (iptables' own `--wait` is unbounded; an
/// agent's change that cannot have it is tried again at its next pass).
const XTABLES_LOCK: &str = "/run/xtables.lock";
const XTABLES_LOCK_WAIT: Duration = Duration::from_secs(5);
const XTABLES_LOCK_POLL: Duration = Duration::from_millis(20);

/// An address family's legacy tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Ipv4, Family::Ipv6];

    /// The `NFPROTO_*` number.
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Ipv4 => libc::NFPROTO_IPV4 as u8,
            Family::Ipv6 => libc::NFPROTO_IPV6 as u8,
        }
    }

    /// The netns's tables of this family: `nat`, `mangle` ...
    pub fn tables(self) -> Vec<String> {
        let file = match self {
            Family::Ipv4 => "ip_tables_names",
            Family::Ipv6 => "ip6_tables_names",
        };
        let names = fs::read_to_string(format!("/proc/thread-self/net/{file}")).unwrap_or_default();
        names
            .lines()
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .map(str::to_owned)
            .collect()
    }

    fn socket(self) -> io::Result<OwnedFd> {
        let domain = match self {
            Family::Ipv4 => libc::AF_INET,
            Family::Ipv6 => libc::AF_INET6,
        };
        // SAFETY: a plain socket(2); the descriptor is owned from here on.
        let fd = unsafe {
            libc::socket(
                domain,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn level(self) -> libc::c_int {
        match self {
            Family::Ipv4 => libc::SOL_IP,
            Family::Ipv6 => libc::SOL_IPV6,
        }
    }

    /// `sizeof(struct ipt_entry)` or `sizeof(struct ip6t_entry)`: where a rule's matches start.
    fn entry_len(self) -> usize {
        match self {
            Family::Ipv4 => 112,
            Family::Ipv6 => 168,
        }
    }

    /// Where a rule's `target_offset` (then `next_offset`) is.
    fn target_offset_at(self) -> usize {
        match self {
            Family::Ipv4 => 88,
            Family::Ipv6 => 140,
        }
    }
}

/// A legacy table as the kernel holds it.
pub struct Table {
    family: Family,
    name: String,
    valid_hooks: u32,
    hook_entry: [u32; HOOKS],
    underflow: [u32; HOOKS],
    rules: Vec<Rule>,
}

/// One rule of a table's blob.
struct Rule {
    /// Its byte offset in the blob.
    offset: u32,
    bytes: Vec<u8>,
    /// The chain it is in (the table's end marker is in none).
    chain: Option<String>,
    /// Where a standard target jumps (or goes to), as a byte offset.
    jump: Option<u32>,
}

impl Table {
    /// Reads the table `name` of `family`, which the netns must have (see the module's doc).
    pub fn read(family: Family, name: &str) -> io::Result<Self> {
        let socket = family.socket()?;
        let mut info = table_name(name)?.to_vec();
        info.resize(INFO_LEN, 0);
        getsockopt(&socket, family, SO_REPLACE_OR_INFO, &mut info)?;
        let valid_hooks = u32_at(&info, 32);
        let hook_entry = std::array::from_fn(|hook| u32_at(&info, 36 + 4 * hook));
        let underflow = std::array::from_fn(|hook| u32_at(&info, 56 + 4 * hook));
        let size = u32_at(&info, 80) as usize;
        let mut entries = table_name(name)?.to_vec();
        entries.resize(ENTRIES_HEADER_LEN + size, 0);
        entries[32..36].copy_from_slice(&(size as u32).to_ne_bytes());
        getsockopt(&socket, family, SO_ADD_COUNTERS_OR_ENTRIES, &mut entries)?;
        let blob = &entries[ENTRIES_HEADER_LEN..];

        let mut rules = Vec::new();
        let mut chain = None;
        let mut offset = 0;
        while offset < blob.len() {
            let at = family.target_offset_at();
            let target_offset = u16_at(blob, offset + at) as usize;
            let next_offset = u16_at(blob, offset + at + 2) as usize;
            if next_offset < family.entry_len() || offset + next_offset > blob.len() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("table {name}: a rule at {offset} runs past the table"),
                ));
            }
            let bytes = blob[offset..offset + next_offset].to_vec();
            let target = &bytes[target_offset..];
            let target_name = nul_terminated(&target[TARGET_NAME]);
            if let Some(hook) = (0..HOOKS)
                .find(|&hook| valid_hooks & (1 << hook) != 0 && hook_entry[hook] as usize == offset)
            {
                chain = Some(BUILTIN_CHAINS[hook].to_owned());
            }
            if target_name == ERROR_TARGET {
                let head = nul_terminated(&target[TARGET_DATA..]);
                chain = (head != ERROR_TARGET).then(|| String::from_utf8_lossy(head).into_owned());
            }
            let verdict = target_name
                .is_empty()
                .then(|| i32_at(target, TARGET_DATA))
                .filter(|verdict| *verdict >= 0);
            rules.push(Rule {
                offset: offset as u32,
                bytes,
                chain: chain.clone(),
                jump: verdict.map(|verdict| verdict as u32),
            });
            offset += next_offset;
        }
        Ok(Self {
            family,
            name: name.to_owned(),
            valid_hooks,
            hook_entry,
            underflow,
            rules,
        })
    }

    /// The table's user chains, in its order.
    pub fn user_chains(&self) -> Vec<&str> {
        let mut chains: Vec<&str> = Vec::new();
        for chain in self.rules.iter().filter_map(|rule| rule.chain.as_deref()) {
            if !BUILTIN_CHAINS.contains(&chain) && chains.last() != Some(&chain) {
                chains.push(chain);
            }
        }
        chains
    }

    /// Removes the user chains `doomed` picks, with every rule of another chain that jumps into
    /// one, in one replacement of the table; the counters of the rules that stay carry over.
    /// Returns the chains removed. A table another writer changes in between is read again.
    pub fn remove_chains(
        family: Family,
        name: &str,
        doomed: impl Fn(&str) -> bool,
    ) -> io::Result<Vec<String>> {
        let _lock = xtables_lock()?;
        let mut tries = 1;
        loop {
            let table = Self::read(family, name)?;
            let removed: Vec<String> = (table.user_chains().into_iter())
                .filter(|chain| doomed(chain))
                .map(str::to_owned)
                .collect();
            if removed.is_empty() {
                return Ok(removed);
            }
            match table.replace_without(&removed) {
                // The kernel's sign that the table changed since it was read.
                Err(error)
                    if error.raw_os_error() == Some(libc::EAGAIN) && tries < REPLACE_TRIES =>
                {
                    tries += 1;
                }
                result => return result.map(|()| removed),
            }
        }
    }

    fn replace_without(&self, removed: &[String]) -> io::Result<()> {
        let chain_at = |offset: u32| {
            let index = self.rules.partition_point(|rule| rule.offset <= offset);
            index
                .checked_sub(1)
                .and_then(|index| self.rules[index].chain.as_deref())
        };
        let is_removed =
            |chain: Option<&str>| chain.is_some_and(|c| removed.iter().any(|r| r == c));
        let kept: Vec<bool> = (self.rules.iter())
            .map(|rule| {
                !is_removed(rule.chain.as_deref())
                    && !rule.jump.is_some_and(|to| is_removed(chain_at(to)))
            })
            .collect();

        // A rule's new offset; an offset of a rule that goes moves to the next rule that stays
        // (in the same chain: a chain's last rule, its policy or return, always stays with it).
        let mut new_offsets = Vec::with_capacity(self.rules.len());
        let mut size = 0u32;
        for (rule, keep) in self.rules.iter().zip(&kept) {
            new_offsets.push(size);
            if *keep {
                size += rule.bytes.len() as u32;
            }
        }
        let moved = |offset: u32| -> io::Result<u32> {
            let index = self.rules.partition_point(|rule| rule.offset < offset);
            (index..self.rules.len())
                .find(|&index| kept[index])
                .map(|index| new_offsets[index])
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("table {}: an offset {offset} past its last rule", self.name),
                    )
                })
        };

        let mut blob = Vec::with_capacity(size as usize);
        for (rule, _) in self.rules.iter().zip(&kept).filter(|(_, keep)| **keep) {
            let start = blob.len();
            blob.extend_from_slice(&rule.bytes);
            if let Some(jump) = rule.jump {
                let target_offset = u16_at(&rule.bytes, self.family.target_offset_at()) as usize;
                let verdict = start + target_offset + TARGET_DATA;
                blob[verdict..verdict + 4].copy_from_slice(&(moved(jump)? as i32).to_ne_bytes());
            }
        }
        let old_count = self.rules.len();
        let new_count = kept.iter().filter(|keep| **keep).count();

        let mut replace = table_name(&self.name)?.to_vec();
        replace.resize(REPLACE_HEADER_LEN, 0);
        put_u32(&mut replace, 32, self.valid_hooks);
        put_u32(&mut replace, 36, new_count as u32);
        put_u32(&mut replace, 40, size);
        for hook in (0..HOOKS).filter(|hook| self.valid_hooks & (1 << hook) != 0) {
            put_u32(&mut replace, 44 + 4 * hook, moved(self.hook_entry[hook])?);
            put_u32(&mut replace, 64 + 4 * hook, moved(self.underflow[hook])?);
        }
        put_u32(&mut replace, 84, old_count as u32);
        let mut old_counters = vec![0u64; 2 * old_count];
        let pointer = old_counters.as_mut_ptr() as u64;
        replace[REPLACE_COUNTERS_POINTER..REPLACE_COUNTERS_POINTER + 8]
            .copy_from_slice(&pointer.to_ne_bytes());
        replace.extend_from_slice(&blob);

        let socket = self.family.socket()?;
        setsockopt(&socket, self.family, SO_REPLACE_OR_INFO, &replace)?;

        // The kept rules' counts, as the kernel had them when it swapped the tables.
        let mut counters = table_name(&self.name)?.to_vec();
        counters.resize(COUNTERS_HEADER_LEN, 0);
        put_u32(&mut counters, 32, new_count as u32);
        for (index, _) in kept.iter().enumerate().filter(|(_, keep)| **keep) {
            for value in &old_counters[2 * index..2 * index + 2] {
                counters.extend_from_slice(&value.to_ne_bytes());
            }
        }
        debug_assert_eq!(
            counters.len(),
            COUNTERS_HEADER_LEN + new_count * COUNTER_LEN
        );
        // Counts lost to another writer's change in between cost nothing but counts.
        match setsockopt(&socket, self.family, SO_ADD_COUNTERS_OR_ENTRIES, &counters) {
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            result => result,
        }
    }
}

/// Holds iptables' lock until dropped. Without the file's directory (no `/run`) there is no
/// other writer to keep out.
fn xtables_lock() -> io::Result<Option<File>> {
    let file = match (OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false))
    .mode(0o600)
    .open(XTABLES_LOCK)
    {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error),
    };
    let deadline = Instant::now() + XTABLES_LOCK_WAIT;
    loop {
        // SAFETY: flock(2) on a descriptor the file owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(file));
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::WouldBlock || Instant::now() >= deadline {
            return Err(io::Error::new(
                error.kind(),
                format!("taking iptables' lock {XTABLES_LOCK}: {error}"),
            ));
        }
        std::thread::sleep(XTABLES_LOCK_POLL);
    }
}

fn table_name(name: &str) -> io::Result<[u8; TABLE_NAME_LEN]> {
    let mut bytes = [0u8; TABLE_NAME_LEN];
    if name.len() >= TABLE_NAME_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("table name {name:?} is too long"),
        ));
    }
    bytes[..name.len()].copy_from_slice(name.as_bytes());
    Ok(bytes)
}

fn getsockopt(
    socket: &OwnedFd,
    family: Family,
    option: libc::c_int,
    buffer: &mut [u8],
) -> io::Result<()> {
    let mut len = buffer.len() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `buffer`.
    let result = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            family.level(),
            option,
            buffer.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn setsockopt(
    socket: &OwnedFd,
    family: Family,
    option: libc::c_int,
    buffer: &[u8],
) -> io::Result<()> {
    // SAFETY: the kernel reads `buffer.len()` bytes from `buffer` (and, for a replacement, writes
    // the old counters where its header points, a buffer the caller keeps alive).
    let result = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            family.level(),
            option,
            buffer.as_ptr().cast(),
            buffer.len() as libc::socklen_t,
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn nul_terminated(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
    &bytes[..end]
}

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

fn i32_at(bytes: &[u8], at: usize) -> i32 {
    i32::from_ne_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

fn put_u32(bytes: &mut [u8], at: usize, value: u32) {
    bytes[at..at + 4].copy_from_slice(&value.to_ne_bytes());
}
