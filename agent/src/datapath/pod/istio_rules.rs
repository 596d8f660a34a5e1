//! istio's own redirection in a pod weir takes over from istio-cni's node agent, and its removal.
//!
//! istio-cni redirects an ambient pod with rules in the pod's netns: `nat` rules that send its
//! traffic to ztunnel's ports (and `raw` ones for DNS), and a return path, `mangle` rules that
//! connmark ztunnel's connections into the pod (`0x111`) and restore that mark on the app's
//! replies, which `ip rule fwmark 0x111/0xfff lookup 100` sends back to ztunnel. istio writes them
//! with iptables (as nf_tables chains named `ISTIO_*` in the `nat`, `mangle` and `raw` tables of
//! each family) or with its nftables backend (the `inet` tables `istio-ambient-nat`,
//! `istio-ambient-mangle`, `istio-ambient-raw`).
//!
//! Once weir's programs redirect the pod, istio's redirection goes at once, in one nf_tables
//! transaction: connections it redirected keep their NAT in conntrack, so they go on, and new
//! ones meet only weir's programs. The return path stays while a connection ztunnel made into the
//! pod under istio's rules lives (a connmark `0x111` in the pod's conntrack table): without it the
//! app's replies to such a connection would leave the pod instead of reaching ztunnel. weir's own
//! return path (its mark and the same table 100) serves every connection made after.
//!
//! istio-cni's agent writes with iptables-legacy where the node's iptables is legacy: the same
//! `ISTIO_*` chains in the legacy tables, removed the same way a table at a time
//! ([`xtables`]'s replacement, which is how iptables-legacy itself deletes a chain).
//!
//! Everything here works in the calling thread's network namespace.

use std::fs;
use std::io;

use tracing::{debug, info, warn};

use weir_common::{ZTUNNEL_MARK, ZTUNNEL_MARK_MASK};

use crate::datapath::kernel::connections;
use crate::datapath::kernel::netlink::Rtnl;
pub use crate::datapath::kernel::nftables::NftObject;
use crate::datapath::kernel::nftables::{Nft, NftChain, NftRule, NftTable};
use crate::datapath::kernel::xtables::{self, Family};

/// The connmark and mask istio gives connections ztunnel made into the pod.
const ISTIO_CONNMARK: u32 = 0x111;
const ISTIO_MARK_MASK: u32 = 0xfff;
/// istio's nftables backend's tables: the redirection, and the return path.
const NFT_REDIRECT_TABLES: [&str; 2] = ["istio-ambient-nat", "istio-ambient-raw"];
const NFT_RETURN_TABLE: &str = "istio-ambient-mangle";
/// The iptables tables whose `ISTIO_*` chains redirect, and the one that holds the return path.
const IPTABLES_REDIRECT_TABLES: [&str; 2] = ["nat", "raw"];
const IPTABLES_RETURN_TABLE: &str = "mangle";
const ISTIO_CHAIN_PREFIX: &str = "ISTIO_";
/// istio-cni's probe SNAT on the node: its iptables chain, its nftables backend's table, and the
/// ipsets of ambient pod addresses the iptables rules match.
const PROBE_SNAT_CHAIN: &str = "ISTIO_POSTRT";
const NFT_PROBE_TABLE: &str = "istio-ambient-nat";
const PROBE_IPSETS: [&str; 2] = ["istio-inpod-probes-v4", "istio-inpod-probes-v6"];
/// How long a set in use is tried again: the rules just deleted release it within milliseconds.
const IPSET_RELEASE_TRIES: u32 = 20;
const IPSET_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_millis(25);

/// What of istio's in-pod redirection a pod still has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IstioRules {
    /// nf_tables objects that send the pod's traffic to ztunnel.
    pub redirection: Vec<NftObject>,
    /// nf_tables objects of the return path.
    pub return_path: Vec<NftObject>,
    /// How many `ip rule`s of the return path (one per family).
    pub return_rules: usize,
    /// The redirection's chains iptables-legacy wrote.
    pub legacy_redirection: Vec<LegacyChain>,
    /// The return path's chains iptables-legacy wrote.
    pub legacy_return_path: Vec<LegacyChain>,
}

/// A user chain in a legacy iptables table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LegacyChain {
    pub family: Family,
    pub table: String,
    pub name: String,
}

impl LegacyChain {
    /// As [`netfilter_leftovers`] names it: `iptables-legacy -t <table> <chain>`.
    fn label(&self) -> String {
        let command = match self.family {
            Family::Ipv4 => "iptables-legacy",
            Family::Ipv6 => "ip6tables-legacy",
        };
        format!("{command} -t {} {}", self.table, self.name)
    }

    /// The user chains `pick` names in the netns's legacy tables.
    fn find(pick: impl Fn(&str, &str) -> bool) -> io::Result<Vec<Self>> {
        let mut found = Vec::new();
        for family in Family::ALL {
            for table in family.tables() {
                let chains = xtables::Table::read(family, &table)?;
                found.extend(
                    (chains.user_chains().into_iter())
                        .filter(|chain| pick(&table, chain))
                        .map(|chain| LegacyChain {
                            family,
                            table: table.clone(),
                            name: chain.to_owned(),
                        }),
                );
            }
        }
        Ok(found)
    }

    /// Removes `chains`, with the rules that jump into them: one replacement per table.
    fn remove(chains: &[Self]) -> io::Result<()> {
        let mut tables: Vec<(Family, &str)> = Vec::new();
        for chain in chains {
            let table = (chain.family, chain.table.as_str());
            if !tables.contains(&table) {
                tables.push(table);
            }
        }
        for (family, table) in tables {
            let doomed = |name: &str| {
                (chains.iter()).any(|c| c.family == family && c.table == table && c.name == name)
            };
            xtables::Table::remove_chains(family, table, doomed)?;
        }
        Ok(())
    }
}

impl IstioRules {
    /// Whether istio redirected this pod (by the rules weir can remove).
    pub fn redirects(&self) -> bool {
        !self.redirection.is_empty() || !self.legacy_redirection.is_empty()
    }

    /// Whether any of the return path (rules, routing) is left.
    pub fn has_return_path(&self) -> bool {
        !self.return_path.is_empty() || !self.legacy_return_path.is_empty() || self.return_rules > 0
    }

    /// Whether istio's `nat` redirection (its `nat` table's `ISTIO_*` chains, or its nftables
    /// backend's `istio-ambient-nat`) is there for IPv4 when `ipv4`, and for IPv6 when `ipv6`:
    /// what sends the pod's new connections to ztunnel. istio writes its tables one at a time
    /// and a family after the other, so another part of its rules says nothing of this.
    pub fn redirect_families(&self, ipv4: bool, ipv6: bool) -> bool {
        let nat_families: Vec<u8> = (self.redirection.iter())
            .filter(|object| matches!(object.table(), "nat" | "istio-ambient-nat"))
            .map(NftObject::family)
            .chain(
                (self.legacy_redirection.iter())
                    .filter(|chain| chain.table == "nat")
                    .map(|chain| chain.family.nfproto()),
            )
            .collect();
        let covered = |family: i32| {
            nat_families
                .iter()
                .any(|&f| i32::from(f) == family || i32::from(f) == libc::NFPROTO_INET)
        };
        (ipv4 || ipv6)
            && (!ipv4 || covered(libc::NFPROTO_IPV4))
            && (!ipv6 || covered(libc::NFPROTO_IPV6))
    }

    pub fn is_empty(&self) -> bool {
        !self.redirects() && !self.has_return_path()
    }

    /// Finds what istio left in the calling thread's netns.
    pub fn find(rtnl: &mut Rtnl) -> io::Result<Self> {
        let mut nft = Nft::new()?;
        let tables = nft.tables()?;
        let chains = nft.chains()?;
        let rules = nft.rules()?;
        let mut found = Self::default();
        for table in &tables {
            let object = || NftObject::Table {
                family: table.family,
                name: table.name.clone(),
            };
            if NFT_REDIRECT_TABLES.contains(&table.name.as_str()) {
                found.redirection.push(object());
            } else if table.name == NFT_RETURN_TABLE {
                found.return_path.push(object());
            }
        }
        for (part, into) in [
            (Part::Redirection, &mut found.redirection),
            (Part::ReturnPath, &mut found.return_path),
        ] {
            let doomed = chains
                .iter()
                .filter(|chain| Part::of_chain(&chain.table, &chain.name) == Some(part));
            into.extend(chains_with_jumps_into_them(doomed.collect(), &rules));
        }
        found.return_rules = rtnl
            .istio_return_rules(ISTIO_CONNMARK, ISTIO_MARK_MASK)?
            .len();
        let legacy = LegacyChain::find(|table, chain| Part::of_chain(table, chain).is_some())?;
        for chain in legacy {
            match Part::of_chain(&chain.table, &chain.name) {
                Some(Part::Redirection) => found.legacy_redirection.push(chain),
                _ => found.legacy_return_path.push(chain),
            }
        }
        Ok(found)
    }

    /// Removes istio's redirection: in one transaction all of it or none (nf_tables), or a
    /// table at a time (iptables-legacy's, where istio wrote it so).
    pub fn remove_redirection(&mut self) -> io::Result<()> {
        Nft::new()?.delete(&self.redirection)?;
        self.redirection.clear();
        LegacyChain::remove(&self.legacy_redirection)?;
        self.legacy_redirection.clear();
        Ok(())
    }

    /// Removes the return path if no connection ztunnel made under istio's rules is left;
    /// returns whether it is gone.
    pub fn remove_return_path_if_drained(&mut self, rtnl: &mut Rtnl) -> io::Result<bool> {
        if !self.has_return_path() {
            return Ok(true);
        }
        if !return_path_drained()? {
            return Ok(false);
        }
        Nft::new()?.delete(&self.return_path)?;
        self.return_path.clear();
        LegacyChain::remove(&self.legacy_return_path)?;
        self.legacy_return_path.clear();
        let rules = rtnl.istio_return_rules(ISTIO_CONNMARK, ISTIO_MARK_MASK)?;
        rtnl.delete_rules(rules)?;
        self.return_rules = 0;
        Ok(true)
    }
}

/// Takes the pod (whose netns the calling thread is in, and which weir's programs redirect
/// now) over from istio's in-pod redirection: removes the redirection at once, and the return
/// path if no connection needs it. Returns whether something is left, for a later call (the
/// owner's audit, which calls it again). Failures are logged and left for that later call, never
/// fatal: istio's rules redirect to the same ztunnel ports as weir's programs, so with them left
/// the pod is still captured.
pub fn take_over(uid: &str, rtnl: &mut Rtnl) -> bool {
    let mut rules = match IstioRules::find(rtnl) {
        Ok(rules) => rules,
        Err(error) => {
            warn!(uid, %error, "looking for istio's in-pod rules");
            return true;
        }
    };
    if rules.redirects() {
        if let Err(error) = rules.remove_redirection() {
            // The return path stays with it: the connections it marks need it.
            warn!(uid, %error, "removing istio's in-pod redirection");
            return true;
        }
        info!(
            uid,
            "istio's in-pod redirection removed: weir's programs redirect the pod, and \
             connections istio's rules redirected go on"
        );
    }
    !retire(uid, &mut rules, rtnl)
}

fn retire(uid: &str, rules: &mut IstioRules, rtnl: &mut Rtnl) -> bool {
    let had_return_path = rules.has_return_path();
    match rules.remove_return_path_if_drained(rtnl) {
        Ok(true) => {
            if had_return_path {
                info!(
                    uid,
                    "istio's in-pod return path removed: no connection needs it"
                );
            }
            true
        }
        Ok(false) => {
            debug!(
                uid,
                "istio's in-pod return path stays while connections ztunnel made under istio's \
                 rules last"
            );
            false
        }
        Err(error) => {
            warn!(uid, %error, "removing istio's in-pod return path");
            false
        }
    }
}

/// weir's table in a pod it hands back to istio-cni's agent (see [`track_ahead_of_istio`]).
const HAND_BACK_TABLE: &str = "weir-hand-back";
/// `NF_INET_PRE_ROUTING` and `NF_INET_LOCAL_OUT`: where istio's `nat` chains hook.
const NAT_HOOKS: [(&str, u32); 2] = [("prerouting", 0), ("output", 3)];
/// `NF_IP_PRI_NAT_DST`, istio's `nat` chains' priority.
const NAT_PRIORITY: i32 = -100;

/// Readies the pod (whose netns the calling thread is in) for istio's rules, so that they take
/// over no connection made under weir's path:
/// - conntrack follows the pod's connections, each with a NAT binding of none, before istio's
///   rules come: `nat` chains accepting all at the hooks and priority of istio's, each with a
///   rule that reads the connection's state (what turns conntrack on in the netns). istio's
///   `REDIRECT`s then apply only to connections whose first packet conntrack sees after they
///   came, never to one made under weir's path, whose packets they would send to a port where
///   no socket holds it;
/// - the connections already established, idle ones among them, are given to conntrack as
///   established (their sockets read from the kernel's socket table): the next packet of one
///   idle until istio's rules are there is not taken for a new connection either. Those
///   between ztunnel and the app get istio's connmark, as istio's rules would have given them,
///   so that the app's replies keep going back to ztunnel;
/// - istio's return rules are there before its netfilter rules mark the packets they route
///   (istio-cni's agent adds them only after).
///
/// Idempotent. Returns how many connections conntrack was given.
pub fn track_ahead_of_istio(rtnl: &mut Rtnl) -> io::Result<usize> {
    rtnl.add_istio_return_rules(ISTIO_CONNMARK, ISTIO_MARK_MASK)?;
    let mut nft = Nft::new()?;
    let tables = nft.tables()?;
    if !tables.iter().any(|table| table.name == HAND_BACK_TABLE) {
        nft.add_conntrack_table(HAND_BACK_TABLE, &NAT_HOOKS, NAT_PRIORITY)?;
    }
    // Without it a connection idle until istio's rules are in is reset: not worth keeping the
    // pod from istio-cni.
    Ok(follow_established(&mut nft).unwrap_or_else(|error| {
        warn!(
            %error,
            "conntrack not given the pod's established connections: one idle until istio's \
             rules are in will be reset at its next packet"
        );
        0
    }))
}

/// Gives conntrack the netns's established TCP connections (see [`track_ahead_of_istio`]);
/// returns how many it did not follow yet.
fn follow_established(nft: &mut Nft) -> io::Result<usize> {
    let mut followed = 0;
    for connection in connections::established_tcp()? {
        let ztunnels = (connection.marks.iter().flatten())
            .any(|mark| mark & ZTUNNEL_MARK_MASK == ZTUNNEL_MARK);
        let connmark = match connection.local && ztunnels {
            true => ISTIO_CONNMARK,
            false => 0,
        };
        followed += usize::from(nft.follow(&connection, connmark)?);
    }
    Ok(followed)
}

/// Removes what [`track_ahead_of_istio`] added, if it is there; the connections it made
/// conntrack follow keep their bindings.
pub fn stop_tracking_ahead_of_istio() -> io::Result<()> {
    let mut nft = Nft::new()?;
    let ours = nft
        .tables()?
        .into_iter()
        .filter(|table| table.name == HAND_BACK_TABLE)
        .map(|table| NftObject::Table {
            family: table.family,
            name: table.name,
        })
        .collect::<Vec<_>>();
    nft.delete(&ours)
}

/// istio's nf_tables tables and chains in the calling thread's netns, as `nft family table
/// [chain]`, its chains in legacy tables, as `iptables-legacy -t table chain`, and its probe
/// ipsets, as `ipset name`: on the node, what istio-cni's agent left there (its probe SNAT); in
/// a pod, its rules.
pub fn netfilter_leftovers() -> io::Result<Vec<String>> {
    let mut nft = Nft::new()?;
    let tables = nft
        .tables()?
        .into_iter()
        .filter(|t| t.name.starts_with("istio-"));
    let mut found: Vec<String> = tables.map(|table| table_label(&table)).collect();
    let chains = nft.chains()?.into_iter();
    found.extend(
        chains
            .filter(|chain| chain.name.starts_with(ISTIO_CHAIN_PREFIX))
            .map(|chain| chain_label(&chain)),
    );
    let legacy = LegacyChain::find(|_, chain| chain.starts_with(ISTIO_CHAIN_PREFIX))?;
    found.extend(legacy.iter().map(LegacyChain::label));
    for set in PROBE_IPSETS {
        if nft.ipset_exists(set)? {
            found.push(format!("ipset {set}"));
        }
    }
    Ok(found)
}

/// Removes istio-cni's probe SNAT from the node (whose netns the calling thread is in), as its
/// agent writes it when it starts: with iptables, the `nat` chain `ISTIO_POSTRT` of each family
/// and the `POSTROUTING` rule that jumps to it, then the ipsets of ambient pod addresses its
/// rules match (`istio-inpod-probes-v4`, `-v6`); with its nftables backend, the table
/// `inet istio-ambient-nat`, sets and all. It gives kubelet's TCP to ambient pods the probe
/// source, which istio's in-pod rules let through to the app; weir's programs give the node's
/// sockets that source themselves, so once no pod is left to istio's rules nothing needs it.
/// iptables-legacy's `ISTIO_POSTRT` goes the same way, from its legacy tables. Returns what was
/// removed, as [`netfilter_leftovers`] names it.
pub fn remove_probe_snat() -> io::Result<Vec<String>> {
    let mut nft = Nft::new()?;
    let mut doomed = Vec::new();
    let mut removed = Vec::new();
    for table in nft.tables()? {
        if table.name == NFT_PROBE_TABLE && i32::from(table.family) == libc::NFPROTO_INET {
            removed.push(table_label(&table));
            doomed.push(NftObject::Table {
                family: table.family,
                name: table.name,
            });
        }
    }
    let chains = nft.chains()?;
    let snat_chains: Vec<&NftChain> = chains
        .iter()
        .filter(|chain| chain.table == "nat" && chain.name == PROBE_SNAT_CHAIN)
        .collect();
    if !snat_chains.is_empty() {
        // Read only here: a node's rules (kube-proxy's) can be many.
        let rules = nft.rules()?;
        removed.extend(snat_chains.iter().map(|chain| chain_label(chain)));
        doomed.extend(chains_with_jumps_into_them(snat_chains, &rules));
    }
    nft.delete(&doomed)?;
    let legacy = LegacyChain::find(|table, chain| table == "nat" && chain == PROBE_SNAT_CHAIN)?;
    LegacyChain::remove(&legacy)?;
    removed.extend(legacy.iter().map(LegacyChain::label));
    for set in PROBE_IPSETS {
        match destroy_once_released(&mut nft, set) {
            Ok(true) => removed.push(format!("ipset {set}")),
            Ok(false) => {}
            Err(error) if error.kind() == io::ErrorKind::ResourceBusy => {
                warn!(%error, "istio-cni's probe ipset left on the node");
            }
            Err(error) => return Err(error),
        }
    }
    Ok(removed)
}

/// Destroys the ipset `set` (whether there was one), trying again while it is in use: the kernel
/// lets go of a deleted rule's sets after the transaction, from a work item.
fn destroy_once_released(nft: &mut Nft, set: &str) -> io::Result<bool> {
    let mut tries = 1;
    loop {
        match nft.destroy_ipset(set) {
            Err(error)
                if error.kind() == io::ErrorKind::ResourceBusy && tries < IPSET_RELEASE_TRIES =>
            {
                tries += 1;
                std::thread::sleep(IPSET_RELEASE_WAIT);
            }
            result => return result,
        }
    }
}

/// An nf_tables table as [`netfilter_leftovers`] names it: `nft <family> <table>`.
fn table_label(table: &NftTable) -> String {
    format!("nft {} {}", family_name(table.family), table.name)
}

/// An nf_tables chain as [`netfilter_leftovers`] names it: `nft <family> <table> <chain>`.
fn chain_label(chain: &NftChain) -> String {
    let family = family_name(chain.family);
    format!("nft {family} {} {}", chain.table, chain.name)
}

fn family_name(family: u8) -> &'static str {
    match i32::from(family) {
        libc::NFPROTO_IPV4 => "ip",
        libc::NFPROTO_IPV6 => "ip6",
        libc::NFPROTO_INET => "inet",
        _ => "other",
    }
}

/// `doomed` as objects to delete in one transaction, after the rules of other chains that jump
/// into them (a chain still referenced cannot go; those of a doomed chain go with it), each
/// chain before the chains it jumps to.
fn chains_with_jumps_into_them(doomed: Vec<&NftChain>, rules: &[NftRule]) -> Vec<NftObject> {
    let is_doomed = |family: u8, table: &str, name: &str| {
        doomed
            .iter()
            .any(|c| c.family == family && c.table == table && c.name == name)
    };
    let mut objects = Vec::new();
    for rule in rules {
        let jumps_in = rule
            .jumps_to
            .iter()
            .any(|target| is_doomed(rule.family, &rule.table, target));
        if jumps_in && !is_doomed(rule.family, &rule.table, &rule.chain) {
            objects.push(NftObject::Rule {
                family: rule.family,
                table: rule.table.clone(),
                chain: rule.chain.clone(),
                handle: rule.handle,
            });
        }
    }
    let referenced = |chain: &NftChain| {
        rules.iter().any(|rule| {
            rule.family == chain.family
                && rule.table == chain.table
                && is_doomed(rule.family, &rule.table, &rule.chain)
                && rule.jumps_to.contains(&chain.name)
        })
    };
    let mut ordered = doomed.clone();
    ordered.sort_by_key(|chain| referenced(chain));
    objects.extend(ordered.into_iter().map(|chain| NftObject::Chain {
        family: chain.family,
        table: chain.table.clone(),
        name: chain.name.clone(),
    }));
    objects
}

/// Whether no connection in the netns's conntrack table needs istio's return path.
/// Unreadable (conntrack's procfs off) counts as not drained: the return path then stays.
fn return_path_drained() -> io::Result<bool> {
    let table = match fs::read_to_string("/proc/thread-self/net/nf_conntrack") {
        Ok(table) => table,
        // No conntrack in this netns at all: nothing to return.
        Err(error) if error.kind() == io::ErrorKind::NotFound && !conntrack_loaded() => {
            return Ok(true)
        }
        Err(error) => return Err(error),
    };
    Ok(!table.lines().any(needs_return_path))
}

/// Whether the connection of a conntrack entry (a line of `nf_conntrack`) needs istio's return
/// path: one made under istio's rules and marked by them (connmark `0x111`: ztunnel's
/// connections into the pod, and the pod's connections istio redirected to ztunnel, whose
/// accepted socket is marked), whose packets the restored mark routes. A closed connection's
/// entry outlives it (TIME_WAIT, CLOSE): nothing to route there.
fn needs_return_path(line: &str) -> bool {
    let fields = || line.split_whitespace();
    let open = !fields().any(|field| matches!(field, "TIME_WAIT" | "CLOSE"));
    let marked = fields()
        .filter_map(|field| field.strip_prefix("mark="))
        .filter_map(|mark| mark.parse::<u32>().ok())
        .any(|mark| mark & ISTIO_MARK_MASK == ISTIO_CONNMARK);
    open && marked
}

fn conntrack_loaded() -> bool {
    fs::metadata("/proc/sys/net/netfilter/nf_conntrack_max").is_ok()
}

/// The two parts of istio's rules, which go at different times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// Sends the pod's traffic to ztunnel, and marks ztunnel's new connections into the pod.
    Redirection,
    /// Brings the app's replies on marked connections back to ztunnel.
    ReturnPath,
}

impl Part {
    /// The part a chain of istio's belongs to (a chain of a table that goes whole is not
    /// listed: it goes with its table).
    fn of_chain(table: &str, chain: &str) -> Option<Self> {
        // The connmark is set on the way in: left in place, it would mark the connections
        // ztunnel makes under weir too, and the return path would never drain.
        let marks = chain.contains("PRERT") || chain.contains("prerouting");
        match table {
            NFT_RETURN_TABLE if marks => Some(Part::Redirection),
            _ if !chain.starts_with(ISTIO_CHAIN_PREFIX) => None,
            IPTABLES_RETURN_TABLE if marks => Some(Part::Redirection),
            IPTABLES_RETURN_TABLE => Some(Part::ReturnPath),
            table if IPTABLES_REDIRECT_TABLES.contains(&table) => Some(Part::Redirection),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::{AsFd, OwnedFd};
    use std::process::{Command, Stdio};

    use super::*;
    use crate::datapath::kernel::netns::enter;
    use crate::datapath::kernel::netns::testing::{privileged, scratch_netns};

    /// Runs `program` with `input` on its stdin, in the calling thread's netns; its stdout.
    fn run(program: &str, args: &[&str], input: &str) -> String {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|error| panic!("{program}: {error}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{program} {args:?}: {stderr}");
        String::from_utf8(output.stdout).unwrap()
    }

    /// istio-cni's probe SNAT as its agent writes it on the node, both ways (iptables with its
    /// ipsets, from istio's `hostprobe_ipv6.golden`; its nftables backend, from the nftables
    /// one), beside a rule and an ipset of someone else's, and an ipset iptables-legacy uses.
    #[test]
    fn istio_cnis_probe_snat_leaves_the_node_and_nothing_else_does() {
        let Some(netns) = privileged(scratch_netns) else {
            return;
        };
        let _inside = enter(netns.as_fd()).unwrap();
        for (set, family) in [
            ("istio-inpod-probes-v4", "inet"),
            ("istio-inpod-probes-v6", "inet6"),
            ("someone-elses", "inet"),
        ] {
            run("ipset", &["create", set, "hash:ip", "family", family], "");
        }
        let snat = |family: &str, to: &str| {
            format!(
                "*nat\n:ISTIO_POSTRT - [0:0]\n-A POSTROUTING -j ISTIO_POSTRT\n-A ISTIO_POSTRT -m \
                 owner --socket-exists -p tcp -m set --match-set istio-inpod-probes-{family} dst \
                 -j SNAT --to-source {to}\n-A POSTROUTING -o eth9 -j MASQUERADE\nCOMMIT\n"
            )
        };
        run(
            "iptables-restore",
            &["--noflush"],
            &snat("v4", "169.254.7.127"),
        );
        let v6 = snat("v6", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff");
        run("ip6tables-restore", &["--noflush"], &v6);
        run(
            "nft",
            &["-f", "-"],
            "add table inet istio-ambient-nat\n\
             add set inet istio-ambient-nat istio-inpod-probes-v4 { type ipv4_addr ; }\n\
             add chain inet istio-ambient-nat postrouting { type nat hook postrouting priority 100 ; }\n\
             add rule inet istio-ambient-nat postrouting meta l4proto tcp skuid 1000 \
             ip daddr @istio-inpod-probes-v4 counter snat to 169.254.7.127\n",
        );
        let sorted = |mut found: Vec<String>| {
            found.sort();
            found
        };
        let istios = [
            "ipset istio-inpod-probes-v4",
            "ipset istio-inpod-probes-v6",
            "nft inet istio-ambient-nat",
            "nft ip nat ISTIO_POSTRT",
            "nft ip6 nat ISTIO_POSTRT",
        ];
        assert_eq!(sorted(netfilter_leftovers().unwrap()), istios);

        assert_eq!(sorted(remove_probe_snat().unwrap()), istios);
        assert_eq!(netfilter_leftovers().unwrap(), Vec::<String>::new());
        for restore in ["iptables-save", "ip6tables-save"] {
            let nat = run(restore, &["-t", "nat"], "");
            assert!(
                nat.contains("-A POSTROUTING -o eth9 -j MASQUERADE"),
                "{nat}"
            );
        }
        assert_eq!(run("ipset", &["list", "-n"], ""), "someone-elses\n");
        assert_eq!(remove_probe_snat().unwrap(), Vec::<String>::new());

        // Where istio-cni's agent wrote it with iptables-legacy: its chain goes the same, then
        // the set it used.
        run("ipset", &["create", "istio-inpod-probes-v4", "hash:ip"], "");
        run(
            "iptables-legacy-restore",
            &["--noflush"],
            &snat("v4", "169.254.7.127"),
        );
        let legacy = [
            "ipset istio-inpod-probes-v4",
            "iptables-legacy -t nat ISTIO_POSTRT",
        ];
        assert_eq!(sorted(netfilter_leftovers().unwrap()), legacy);
        assert_eq!(sorted(remove_probe_snat().unwrap()), legacy);
        assert_eq!(netfilter_leftovers().unwrap(), Vec::<String>::new());
        let nat = run("iptables-legacy-save", &["-t", "nat"], "");
        assert!(
            nat.contains("-A POSTROUTING -o eth9 -j MASQUERADE") && !nat.contains("ISTIO"),
            "{nat}"
        );
    }

    /// istio's in-pod rules as istio-cni's agent writes them where the node's iptables is
    /// legacy (its ambient golden's chains, shortened), with the jumps into them among rules of
    /// someone else's: a chain of theirs, a goto, counts. Both families.
    fn legacy_ruleset(lo: &str) -> String {
        format!(
            "\
*mangle
:PREROUTING ACCEPT [3:180]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
:OTHERS - [0:0]
[1:60] -A PREROUTING -j ISTIO_PRERT
[2:120] -A PREROUTING -m mark --mark 0x7 -j OTHERS
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
[5:500] -A OTHERS -j MARK --set-xmark 0x8/0xff
COMMIT
*nat
:PREROUTING ACCEPT [7:420]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
:ISTIO_PRERT - [0:0]
:OTHERS - [0:0]
[4:240] -A PREROUTING -p tcp -m tcp --dport 9 -j OTHERS
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
[6:360] -A OUTPUT -p udp -g OTHERS
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d {lo} -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
-A ISTIO_PRERT ! -d {lo} -p tcp -m tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006
-A OTHERS -p tcp -j REDIRECT --to-ports 9999
-A POSTROUTING -o eth9 -j MASQUERADE
COMMIT
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:ISTIO_OUTPUT - [0:0]
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
COMMIT
"
        )
    }

    /// Taken over, a pod whose istio rules iptables-legacy wrote keeps every other rule of its
    /// tables as if istio had never written there, counts and all: its redirection goes first,
    /// then its return path.
    #[test]
    fn istios_legacy_in_pod_rules_leave_and_nothing_else_does() {
        let (Some(pod), Some(pristine)) = (privileged(scratch_netns), privileged(scratch_netns))
        else {
            return;
        };
        let families = [
            ("iptables-legacy", "127.0.0.1/32"),
            ("ip6tables-legacy", "::1/128"),
        ];
        for (command, lo) in families {
            let restore = format!("{command}-restore");
            let all = legacy_ruleset(lo);
            let others: String = (all.lines())
                .filter(|line| !line.contains("ISTIO"))
                .map(|line| format!("{line}\n"))
                .collect();
            let _in_pod = enter(pod.as_fd()).unwrap();
            run(&restore, &["-c"], &all);
            let _in_pristine = enter(pristine.as_fd()).unwrap();
            run(&restore, &["-c"], &others);
        }

        let _inside = enter(pod.as_fd()).unwrap();
        let mut rtnl = Rtnl::new().unwrap();
        let mut rules = IstioRules::find(&mut rtnl).unwrap();
        let labels = |chains: &[LegacyChain]| {
            let mut labels: Vec<String> = chains.iter().map(LegacyChain::label).collect();
            labels.sort();
            labels
        };
        assert!(rules.redirect_families(true, true), "{rules:?}");
        assert_eq!(
            labels(&rules.legacy_redirection),
            [
                "ip6tables-legacy -t mangle ISTIO_PRERT",
                "ip6tables-legacy -t nat ISTIO_OUTPUT",
                "ip6tables-legacy -t nat ISTIO_PRERT",
                "ip6tables-legacy -t raw ISTIO_OUTPUT",
                "iptables-legacy -t mangle ISTIO_PRERT",
                "iptables-legacy -t nat ISTIO_OUTPUT",
                "iptables-legacy -t nat ISTIO_PRERT",
                "iptables-legacy -t raw ISTIO_OUTPUT",
            ]
        );
        let return_path = [
            "ip6tables-legacy -t mangle ISTIO_OUTPUT",
            "iptables-legacy -t mangle ISTIO_OUTPUT",
        ];
        assert_eq!(labels(&rules.legacy_return_path), return_path);

        rules.remove_redirection().unwrap();
        let left = IstioRules::find(&mut rtnl).unwrap();
        assert!(!left.redirects(), "{left:?}");
        assert_eq!(labels(&left.legacy_return_path), return_path);
        assert!(rules.remove_return_path_if_drained(&mut rtnl).unwrap());
        let left = IstioRules::find(&mut rtnl).unwrap();
        assert!(left.is_empty(), "{left:?}");

        let saved = |netns: &OwnedFd, command: &str| {
            let _in = enter(netns.as_fd()).unwrap();
            let save = run(&format!("{command}-save"), &["-c"], "");
            (save.lines())
                .filter(|line| !line.starts_with('#'))
                .map(|line| format!("{line}\n"))
                .collect::<String>()
        };
        for (command, _) in families {
            assert_eq!(saved(&pod, command), saved(&pristine, command), "{command}");
        }
    }

    #[test]
    fn a_family_is_redirected_once_istios_nat_rules_for_it_are_there() {
        let chain = |family: i32, table: &str| NftObject::Chain {
            family: family as u8,
            table: table.into(),
            name: "ISTIO_PRERT".into(),
        };
        let rules = |redirection| IstioRules {
            redirection,
            ..IstioRules::default()
        };
        // Its mangle table is written before its nat table: not yet.
        let mangle_only = rules(vec![chain(libc::NFPROTO_IPV4, "mangle")]);
        assert!(!mangle_only.redirect_families(true, false));
        let ipv4_only = rules(vec![
            chain(libc::NFPROTO_IPV4, "mangle"),
            chain(libc::NFPROTO_IPV4, "nat"),
        ]);
        assert!(ipv4_only.redirect_families(true, false));
        assert!(!ipv4_only.redirect_families(true, true), "IPv6 not yet");
        let nft_backend = rules(vec![chain(libc::NFPROTO_INET, "istio-ambient-nat")]);
        assert!(nft_backend.redirect_families(true, true));
        assert!(!rules(Vec::new()).redirect_families(false, false));
    }

    #[test]
    fn open_connections_marked_under_istios_rules_need_the_return_path() {
        let into_the_app = "ipv4 2 tcp 6 431999 ESTABLISHED src=10.244.0.2 dst=10.244.0.3 \
            sport=53681 dport=8080 src=10.244.0.3 dst=10.244.0.2 sport=8080 dport=53681 \
            [ASSURED] mark=273 zone=0 use=2";
        assert!(needs_return_path(into_the_app));
        let out_of_the_app = "ipv4 2 tcp 6 431999 ESTABLISHED src=10.244.0.3 dst=10.244.0.4 \
            sport=50628 dport=8080 src=127.0.0.1 dst=10.244.0.3 sport=15001 dport=50628 \
            [ASSURED] mark=273 zone=0 use=2";
        assert!(needs_return_path(out_of_the_app));
        // Other bits of the mark are not istio's.
        assert!(needs_return_path(
            &into_the_app.replace("mark=273", "mark=4369")
        ));
        assert!(!needs_return_path(
            &into_the_app.replace("mark=273", "mark=0")
        ));
        for closed in ["TIME_WAIT", "CLOSE"] {
            assert!(!needs_return_path(
                &into_the_app.replace("ESTABLISHED", closed)
            ));
        }
    }
}
