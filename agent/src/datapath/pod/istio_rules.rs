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
//! Rules written by iptables-legacy are not nf_tables objects; they are found (the netns's
//! legacy tables) and reported, not removed: weir's programs redirect the pod the same with them
//! in place.
//!
//! Everything here works in the calling thread's network namespace.

use std::fs;
use std::io;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};
use tracing::{debug, info, warn};

use crate::datapath::kernel::netlink::Rtnl;

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

/// What of istio's in-pod redirection a pod still has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IstioRules {
    /// nf_tables objects that send the pod's traffic to ztunnel.
    pub redirection: Vec<NftObject>,
    /// nf_tables objects of the return path.
    pub return_path: Vec<NftObject>,
    /// How many `ip rule`s of the return path (one per family).
    pub return_rules: usize,
    /// Legacy iptables tables present in the netns (`/proc/net/ip_tables_names` and its IPv6
    /// twin): rules there cannot be told apart or removed without iptables-legacy.
    pub legacy_tables: Vec<String>,
}

impl IstioRules {
    /// Whether istio redirected this pod (by the rules weir can remove).
    pub fn redirects(&self) -> bool {
        !self.redirection.is_empty()
    }

    /// Whether istio's `nat` redirection (its `nat` table's `ISTIO_*` chains, or its nftables
    /// backend's `istio-ambient-nat`) is there for IPv4 when `ipv4`, and for IPv6 when `ipv6`:
    /// what sends the pod's new connections to ztunnel. istio writes its tables one at a time
    /// and a family after the other, so another part of its rules says nothing of this.
    pub fn redirect_families(&self, ipv4: bool, ipv6: bool) -> bool {
        let nat_families: Vec<u8> = (self.redirection.iter())
            .filter(|object| matches!(object.table(), "nat" | "istio-ambient-nat"))
            .map(NftObject::family)
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
        self.redirection.is_empty() && self.return_path.is_empty() && self.return_rules == 0
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
            let doomed: Vec<&NftChain> = chains
                .iter()
                .filter(|chain| Part::of_chain(&chain.table, &chain.name) == Some(part))
                .collect();
            let is_doomed = |family: u8, table: &str, name: &str| {
                doomed
                    .iter()
                    .any(|c| c.family == family && c.table == table && c.name == name)
            };
            // The jumps into them go first (a chain still referenced cannot go), but not those
            // from a chain that goes too: its rules go with it.
            for rule in &rules {
                let jumps_in = rule
                    .jumps_to
                    .iter()
                    .any(|target| is_doomed(rule.family, &rule.table, target));
                if jumps_in && !is_doomed(rule.family, &rule.table, &rule.chain) {
                    into.push(NftObject::Rule {
                        family: rule.family,
                        table: rule.table.clone(),
                        chain: rule.chain.clone(),
                        handle: rule.handle,
                    });
                }
            }
            // A chain that goes before the chains it jumps to.
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
            into.extend(ordered.into_iter().map(|chain| NftObject::Chain {
                family: chain.family,
                table: chain.table.clone(),
                name: chain.name.clone(),
            }));
        }
        found.return_rules = rtnl
            .istio_return_rules(ISTIO_CONNMARK, ISTIO_MARK_MASK)?
            .len();
        found.legacy_tables = legacy_tables();
        Ok(found)
    }

    /// Removes istio's redirection, in one transaction: all of it or none.
    pub fn remove_redirection(&mut self) -> io::Result<()> {
        Nft::new()?.delete(&self.redirection)?;
        self.redirection.clear();
        Ok(())
    }

    /// Removes the return path if no connection ztunnel made under istio's rules is left;
    /// returns whether it is gone.
    pub fn remove_return_path_if_drained(&mut self, rtnl: &mut Rtnl) -> io::Result<bool> {
        if self.return_path.is_empty() && self.return_rules == 0 {
            return Ok(true);
        }
        if !return_path_drained()? {
            return Ok(false);
        }
        Nft::new()?.delete(&self.return_path)?;
        self.return_path.clear();
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
    if !rules.legacy_tables.is_empty() && rules.is_empty() {
        debug!(
            uid,
            tables = ?rules.legacy_tables,
            "the pod has legacy iptables tables, which weir neither reads nor removes"
        );
    }
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
    let had_return_path = !rules.return_path.is_empty() || rules.return_rules > 0;
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

/// Readies the pod (whose netns the calling thread is in) for istio's rules, so that they take
/// over no connection made under weir's path:
/// - conntrack follows the pod's connections, each with a NAT binding of none, before istio's
///   rules come: `nat` chains accepting all at the hooks and priority of istio's, each with a
///   rule that reads the connection's state (what turns conntrack on in the netns). istio's
///   `REDIRECT`s then apply only to connections whose first packet conntrack sees after they
///   came, never to one made under weir's path, whose packets they would send to a port where
///   no socket holds it. A connection with no packet between this and istio's rules is not
///   followed in time;
/// - istio's return rules are there before its netfilter rules mark the packets they route
///   (istio-cni's agent adds them only after).
///
/// Idempotent.
pub fn track_ahead_of_istio(rtnl: &mut Rtnl) -> io::Result<()> {
    rtnl.add_istio_return_rules(ISTIO_CONNMARK, ISTIO_MARK_MASK)?;
    let mut nft = Nft::new()?;
    if nft
        .tables()?
        .iter()
        .any(|table| table.name == HAND_BACK_TABLE)
    {
        return Ok(());
    }
    let family = libc::NFPROTO_INET as u8;
    let mut messages = vec![NftMessage {
        kind: NFT_MSG_NEWTABLE,
        flags: libc::NLM_F_CREATE as u16,
        family,
        attrs: vec![string(NFTA_TABLE_NAME, HAND_BACK_TABLE)],
        what: format!("adding table inet {HAND_BACK_TABLE}"),
    }];
    for (name, hook) in NAT_HOOKS {
        let hook = nested(&[
            (NFTA_HOOK_HOOKNUM, hook.to_be_bytes().to_vec()),
            (NFTA_HOOK_PRIORITY, NAT_PRIORITY.to_be_bytes().to_vec()),
        ]);
        messages.push(NftMessage {
            kind: NFT_MSG_NEWCHAIN,
            flags: libc::NLM_F_CREATE as u16,
            family,
            attrs: vec![
                string(NFTA_CHAIN_TABLE, HAND_BACK_TABLE),
                string(NFTA_CHAIN_NAME, name),
                (NFTA_CHAIN_HOOK | NLA_F_NESTED, hook),
                (NFTA_CHAIN_POLICY, NF_ACCEPT.to_be_bytes().to_vec()),
                string(NFTA_CHAIN_TYPE, "nat"),
            ],
            what: format!("adding chain inet {HAND_BACK_TABLE} {name}"),
        });
        // `ct load state => reg 1`, read by nothing: the chain's need of conntrack.
        let ct_state = nested(&[
            (NFTA_CT_DREG, NFT_REG_1.to_be_bytes().to_vec()),
            (NFTA_CT_KEY, NFT_CT_STATE.to_be_bytes().to_vec()),
        ]);
        let expression = nested(&[
            string(NFTA_EXPR_NAME, "ct"),
            (NFTA_EXPR_DATA | NLA_F_NESTED, ct_state),
        ]);
        messages.push(NftMessage {
            kind: NFT_MSG_NEWRULE,
            flags: (libc::NLM_F_CREATE | libc::NLM_F_APPEND) as u16,
            family,
            attrs: vec![
                string(NFTA_RULE_TABLE, HAND_BACK_TABLE),
                string(NFTA_RULE_CHAIN, name),
                (
                    NFTA_RULE_EXPRESSIONS | NLA_F_NESTED,
                    nested(&[(NFTA_LIST_ELEM | NLA_F_NESTED, expression)]),
                ),
            ],
            what: format!("adding a rule to chain inet {HAND_BACK_TABLE} {name}"),
        });
    }
    nft.commit(messages)
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

/// istio's nf_tables tables and chains in the calling thread's netns, as `family table [chain]`:
/// on the node, what istio-cni's agent left there (its probe SNAT chain); in a pod, its rules.
pub fn nft_leftovers() -> io::Result<Vec<String>> {
    let mut nft = Nft::new()?;
    let family = |family: u8| match i32::from(family) {
        libc::NFPROTO_IPV4 => "ip",
        libc::NFPROTO_IPV6 => "ip6",
        libc::NFPROTO_INET => "inet",
        _ => "other",
    };
    let tables = nft
        .tables()?
        .into_iter()
        .filter(|t| t.name.starts_with("istio-"));
    let mut found: Vec<String> = tables
        .map(|table| format!("{} {}", family(table.family), table.name))
        .collect();
    let chains = nft.chains()?.into_iter();
    found.extend(
        chains
            .filter(|chain| chain.name.starts_with(ISTIO_CHAIN_PREFIX))
            .map(|chain| format!("{} {} {}", family(chain.family), chain.table, chain.name)),
    );
    Ok(found)
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

/// The legacy iptables tables the netns has.
fn legacy_tables() -> Vec<String> {
    ["ip_tables_names", "ip6_tables_names"]
        .iter()
        .filter_map(|file| fs::read_to_string(format!("/proc/thread-self/net/{file}")).ok())
        .flat_map(|names| {
            names
                .lines()
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
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

/// One nf_tables object weir removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NftObject {
    Table {
        family: u8,
        name: String,
    },
    Chain {
        family: u8,
        table: String,
        name: String,
    },
    Rule {
        family: u8,
        table: String,
        chain: String,
        handle: u64,
    },
}

impl NftObject {
    fn family(&self) -> u8 {
        match self {
            Self::Table { family, .. } | Self::Chain { family, .. } | Self::Rule { family, .. } => {
                *family
            }
        }
    }

    fn table(&self) -> &str {
        match self {
            Self::Table { name, .. } => name,
            Self::Chain { table, .. } | Self::Rule { table, .. } => table,
        }
    }
}

struct NftTable {
    family: u8,
    name: String,
}

struct NftChain {
    family: u8,
    table: String,
    name: String,
}

struct NftRule {
    family: u8,
    table: String,
    chain: String,
    handle: u64,
    /// The chains the rule's verdicts jump or go to.
    jumps_to: Vec<String>,
}

// nf_tables' netlink vocabulary (linux/netfilter/nf_tables.h, nfnetlink.h).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_DELTABLE: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_DELRULE: u16 = 8;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFT_CT_STATE: u32 = 0;
const NFT_REG_1: u32 = 1;
const NF_ACCEPT: u32 = 1;
/// `NF_INET_PRE_ROUTING` and `NF_INET_LOCAL_OUT`: where istio's `nat` chains hook.
const NAT_HOOKS: [(&str, u32); 2] = [("prerouting", 0), ("output", 3)];
/// `NF_IP_PRI_NAT_DST`, istio's `nat` chains' priority.
const NAT_PRIORITY: i32 = -100;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_TYPE_MASK: u16 = 0x3fff;
/// The header of every nfnetlink message after the netlink one: family, version, resource id.
const NFGENMSG_LEN: usize = 4;
const NLMSG_HDRLEN: usize = 16;
/// Room for one datagram: the kernel fills at most 32 KiB per `recv`.
const RECV_BUFFER: usize = 32 * 1024;

/// One message of a transaction, with what it does for an error's message.
struct NftMessage {
    kind: u16,
    flags: u16,
    family: u8,
    attrs: Vec<(u16, Vec<u8>)>,
    what: String,
}

/// A netlink socket for nf_tables, in the calling thread's netns.
struct Nft {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Nft {
    fn new() -> io::Result<Self> {
        let socket = Socket::new(NETLINK_NETFILTER)?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// The next datagram.
    fn recv(&mut self) -> io::Result<&[u8]> {
        self.buffer.clear();
        // MSG_TRUNC: the return value is the datagram's full length, so truncation shows.
        let length = self.socket.recv(&mut self.buffer, libc::MSG_TRUNC)?;
        if length > self.buffer.len() {
            return Err(io::Error::other(format!(
                "netlink reply of {length} bytes truncated"
            )));
        }
        Ok(&self.buffer)
    }

    fn tables(&mut self) -> io::Result<Vec<NftTable>> {
        self.dump(NFT_MSG_GETTABLE, |family, attrs| {
            Some(NftTable {
                family,
                name: string_attr(attrs, NFTA_TABLE_NAME)?,
            })
        })
    }

    fn chains(&mut self) -> io::Result<Vec<NftChain>> {
        self.dump(NFT_MSG_GETCHAIN, |family, attrs| {
            Some(NftChain {
                family,
                table: string_attr(attrs, NFTA_CHAIN_TABLE)?,
                name: string_attr(attrs, NFTA_CHAIN_NAME)?,
            })
        })
    }

    fn rules(&mut self) -> io::Result<Vec<NftRule>> {
        self.dump(NFT_MSG_GETRULE, |family, attrs| {
            let handle = attr(attrs, NFTA_RULE_HANDLE)?;
            Some(NftRule {
                family,
                table: string_attr(attrs, NFTA_RULE_TABLE)?,
                chain: string_attr(attrs, NFTA_RULE_CHAIN)?,
                handle: u64::from_be_bytes(handle.get(..8)?.try_into().ok()?),
                jumps_to: attr(attrs, NFTA_RULE_EXPRESSIONS)
                    .map(jump_targets)
                    .unwrap_or_default(),
            })
        })
    }

    /// Deletes `objects`, in order, in one transaction.
    fn delete(&mut self, objects: &[NftObject]) -> io::Result<()> {
        let messages = objects
            .iter()
            .map(|object| {
                let (kind, family, attrs) = match object {
                    NftObject::Table { family, name } => (
                        NFT_MSG_DELTABLE,
                        *family,
                        vec![string(NFTA_TABLE_NAME, name)],
                    ),
                    NftObject::Chain {
                        family,
                        table,
                        name,
                    } => (
                        NFT_MSG_DELCHAIN,
                        *family,
                        vec![
                            string(NFTA_CHAIN_TABLE, table),
                            string(NFTA_CHAIN_NAME, name),
                        ],
                    ),
                    NftObject::Rule {
                        family,
                        table,
                        chain,
                        handle,
                    } => (
                        NFT_MSG_DELRULE,
                        *family,
                        vec![
                            string(NFTA_RULE_TABLE, table),
                            string(NFTA_RULE_CHAIN, chain),
                            (NFTA_RULE_HANDLE, handle.to_be_bytes().to_vec()),
                        ],
                    ),
                };
                NftMessage {
                    kind,
                    flags: 0,
                    family,
                    attrs,
                    what: format!("deleting {object:?}"),
                }
            })
            .collect();
        self.commit(messages)
    }

    /// Sends `messages` in one transaction: all of them happen, or none.
    fn commit(&mut self, messages: Vec<NftMessage>) -> io::Result<()> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut datagram = Vec::new();
        let begin = self.next_sequence();
        push_message(
            &mut datagram,
            NFNL_MSG_BATCH_BEGIN,
            0,
            begin,
            (0, NFNL_SUBSYS_NFTABLES),
            &[],
        );
        let first = begin.wrapping_add(1);
        for message in &messages {
            let sequence = self.next_sequence();
            push_message(
                &mut datagram,
                nft_type(message.kind),
                message.flags | libc::NLM_F_ACK as u16,
                sequence,
                (message.family, 0),
                &message.attrs,
            );
        }
        let end = self.next_sequence();
        push_message(
            &mut datagram,
            NFNL_MSG_BATCH_END,
            0,
            end,
            (0, NFNL_SUBSYS_NFTABLES),
            &[],
        );
        self.socket.send(&datagram, 0)?;
        // One answer per message: an ack, or the error that aborted the whole transaction.
        let mut answered = 0;
        while answered < messages.len() {
            for (kind, sequence, payload) in netlink_messages(self.recv()?) {
                let index = sequence.wrapping_sub(first) as usize;
                if kind != NLMSG_ERROR || index >= messages.len() {
                    continue;
                }
                let errno = error_code(payload);
                if errno != 0 {
                    let error = io::Error::from_raw_os_error(-errno);
                    return Err(io::Error::new(
                        error.kind(),
                        format!("{}: {error}", messages[index].what),
                    ));
                }
                answered += 1;
            }
        }
        Ok(())
    }

    /// Every object of `kind` in the netns, of every family, as `parse` reads them.
    fn dump<T>(&mut self, kind: u16, parse: impl Fn(u8, &[u8]) -> Option<T>) -> io::Result<Vec<T>> {
        let sequence = self.next_sequence();
        let mut request = Vec::new();
        push_message(
            &mut request,
            nft_type(kind),
            libc::NLM_F_DUMP as u16,
            sequence,
            (libc::NFPROTO_UNSPEC as u8, 0),
            &[],
        );
        self.socket.send(&request, 0)?;
        let mut found = Vec::new();
        loop {
            for (message_kind, message_sequence, payload) in netlink_messages(self.recv()?) {
                if message_sequence != sequence {
                    continue;
                }
                match message_kind {
                    NLMSG_DONE => return Ok(found),
                    NLMSG_ERROR => {
                        let errno = error_code(payload);
                        if errno == 0 {
                            return Ok(found);
                        }
                        // No nf_tables at all in this kernel: nothing of istio's there.
                        if -errno == libc::EOPNOTSUPP || -errno == libc::EPROTONOSUPPORT {
                            return Ok(found);
                        }
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    _ if payload.len() >= NFGENMSG_LEN => {
                        if let Some(object) = parse(payload[0], &payload[NFGENMSG_LEN..]) {
                            found.push(object);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    fn next_sequence(&mut self) -> u32 {
        self.sequence = self.sequence.wrapping_add(1);
        self.sequence
    }
}

/// Netlink attributes, encoded one after the other (a nested attribute's payload).
fn nested(attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (kind, value) in attrs {
        let length = 4 + value.len();
        bytes.extend_from_slice(&(length as u16).to_ne_bytes());
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(value);
        bytes.resize(bytes.len() + padding(length), 0);
    }
    bytes
}

/// The (negative) errno of an `NLMSG_ERROR` message's payload; 0 is an ack.
fn error_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .and_then(|code| code.try_into().ok())
        .map_or(0, i32::from_ne_bytes)
}

fn nft_type(kind: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | kind
}

fn string(kind: u16, value: &str) -> (u16, Vec<u8>) {
    let mut bytes = value.as_bytes().to_vec();
    bytes.push(0);
    (kind, bytes)
}

/// Appends one netlink message with an nfnetlink header (`family`, resource id) and `attrs`.
fn push_message(
    datagram: &mut Vec<u8>,
    kind: u16,
    flags: u16,
    sequence: u32,
    (family, resource): (u8, u16),
    attrs: &[(u16, Vec<u8>)],
) {
    let start = datagram.len();
    datagram.extend_from_slice(&[0; 4]); // length, below
    datagram.extend_from_slice(&kind.to_ne_bytes());
    datagram.extend_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
    datagram.extend_from_slice(&sequence.to_ne_bytes());
    datagram.extend_from_slice(&0u32.to_ne_bytes());
    datagram.extend_from_slice(&[family, 0]);
    datagram.extend_from_slice(&resource.to_be_bytes());
    datagram.extend_from_slice(&nested(attrs));
    let length = (datagram.len() - start) as u32;
    datagram[start..start + 4].copy_from_slice(&length.to_ne_bytes());
}

fn padding(length: usize) -> usize {
    (4 - length % 4) % 4
}

/// The netlink messages of a datagram: (type, sequence, payload after the netlink header).
fn netlink_messages(mut datagram: &[u8]) -> impl Iterator<Item = (u16, u32, &[u8])> {
    std::iter::from_fn(move || {
        let header = datagram.get(..NLMSG_HDRLEN)?;
        let length = u32::from_ne_bytes(header[..4].try_into().ok()?) as usize;
        if length < NLMSG_HDRLEN || length > datagram.len() {
            return None;
        }
        let kind = u16::from_ne_bytes(header[4..6].try_into().ok()?);
        let sequence = u32::from_ne_bytes(header[8..12].try_into().ok()?);
        let payload = &datagram[NLMSG_HDRLEN..length];
        datagram = &datagram[(length + padding(length)).min(datagram.len())..];
        Some((kind, sequence, payload))
    })
}

/// The attributes in `bytes`: (type without flags, payload).
fn attrs(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let length = u16::from_ne_bytes(bytes.get(..2)?.try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(bytes.get(2..4)?.try_into().ok()?) & NLA_TYPE_MASK;
        if length < 4 || length > bytes.len() {
            return None;
        }
        let payload = &bytes[4..length];
        bytes = &bytes[(length + padding(length)).min(bytes.len())..];
        Some((kind, payload))
    })
}

fn attr(bytes: &[u8], kind: u16) -> Option<&[u8]> {
    attrs(bytes)
        .find(|(found, _)| *found == kind)
        .map(|(_, payload)| payload)
}

fn string_attr(bytes: &[u8], kind: u16) -> Option<String> {
    let value = attr(bytes, kind)?;
    let value = value.split(|&byte| byte == 0).next().unwrap_or(value);
    Some(String::from_utf8_lossy(value).into_owned())
}

/// The chains a rule's `immediate` verdicts jump or go to (`-j CHAIN` in iptables-nft, `jump` and
/// `goto` in nft).
fn jump_targets(expressions: &[u8]) -> Vec<String> {
    attrs(expressions)
        .filter(|(kind, _)| *kind == NFTA_LIST_ELEM)
        .filter(|(_, expression)| {
            string_attr(expression, NFTA_EXPR_NAME).as_deref() == Some("immediate")
        })
        .filter_map(|(_, expression)| {
            let data = attr(expression, NFTA_EXPR_DATA)?;
            let verdict = attr(attr(data, NFTA_IMMEDIATE_DATA)?, NFTA_DATA_VERDICT)?;
            let code = i32::from_be_bytes(
                attr(verdict, NFTA_VERDICT_CODE)?
                    .get(..4)?
                    .try_into()
                    .ok()?,
            );
            matches!(code, NFT_JUMP | NFT_GOTO)
                .then(|| string_attr(verdict, NFTA_VERDICT_CHAIN))
                .flatten()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
