//! A netlink client for nf_tables and ipset (both under nfnetlink), as much of it as weir needs to
//! find, add and remove another agent's netfilter objects in a network namespace: dumps of
//! tables, chains and rules, transactions, and ipset's header and destroy commands.
//!
//! Everything here works in the calling thread's network namespace.
use std::io;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

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
    pub(in crate::datapath) fn family(&self) -> u8 {
        match self {
            Self::Table { family, .. } | Self::Chain { family, .. } | Self::Rule { family, .. } => {
                *family
            }
        }
    }

    pub(in crate::datapath) fn table(&self) -> &str {
        match self {
            Self::Table { name, .. } => name,
            Self::Chain { table, .. } | Self::Rule { table, .. } => table,
        }
    }
}

pub(in crate::datapath) struct NftTable {
    pub(in crate::datapath) family: u8,
    pub(in crate::datapath) name: String,
}

pub(in crate::datapath) struct NftChain {
    pub(in crate::datapath) family: u8,
    pub(in crate::datapath) table: String,
    pub(in crate::datapath) name: String,
}

pub(in crate::datapath) struct NftRule {
    pub(in crate::datapath) family: u8,
    pub(in crate::datapath) table: String,
    pub(in crate::datapath) chain: String,
    pub(in crate::datapath) handle: u64,
    /// The chains the rule's verdicts jump or go to.
    pub(in crate::datapath) jumps_to: Vec<String>,
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
// ipset's (linux/netfilter/ipset/ip_set.h). Protocol 6 is the oldest every kernel since 3.x
// takes; the commands used here read nothing newer.
const NFNL_SUBSYS_IPSET: u16 = 6;
const IPSET_CMD_DESTROY: u16 = 3;
const IPSET_CMD_HEADER: u16 = 12;
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
const IPSET_PROTOCOL: u8 = 6;
/// The set is referenced (by an iptables rule's `-m set`, or a `SET` target).
const IPSET_ERR_BUSY: i32 = 4100;
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

/// A netlink socket for nf_tables and ipset, in the calling thread's netns.
pub(in crate::datapath) struct Nft {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Nft {
    pub(in crate::datapath) fn new() -> io::Result<Self> {
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

    pub(in crate::datapath) fn tables(&mut self) -> io::Result<Vec<NftTable>> {
        self.dump(NFT_MSG_GETTABLE, |family, attrs| {
            Some(NftTable {
                family,
                name: string_attr(attrs, NFTA_TABLE_NAME)?,
            })
        })
    }

    pub(in crate::datapath) fn chains(&mut self) -> io::Result<Vec<NftChain>> {
        self.dump(NFT_MSG_GETCHAIN, |family, attrs| {
            Some(NftChain {
                family,
                table: string_attr(attrs, NFTA_CHAIN_TABLE)?,
                name: string_attr(attrs, NFTA_CHAIN_NAME)?,
            })
        })
    }

    pub(in crate::datapath) fn rules(&mut self) -> io::Result<Vec<NftRule>> {
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
    pub(in crate::datapath) fn delete(&mut self, objects: &[NftObject]) -> io::Result<()> {
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

    /// Adds table `inet <name>` with a `nat` chain at each of `hooks` (chain name, `NF_INET_*`
    /// hook number) at `priority`, policy accept, each holding one rule that loads the
    /// connection's state and does nothing with it: what makes conntrack follow the netns's
    /// connections, each with a NAT binding of none. One transaction.
    pub(in crate::datapath) fn add_conntrack_table(
        &mut self,
        name: &str,
        hooks: &[(&str, u32)],
        priority: i32,
    ) -> io::Result<()> {
        let family = libc::NFPROTO_INET as u8;
        let mut messages = vec![NftMessage {
            kind: NFT_MSG_NEWTABLE,
            flags: libc::NLM_F_CREATE as u16,
            family,
            attrs: vec![string(NFTA_TABLE_NAME, name)],
            what: format!("adding table inet {name}"),
        }];
        for &(chain, hook) in hooks {
            let hook = nested(&[
                (NFTA_HOOK_HOOKNUM, hook.to_be_bytes().to_vec()),
                (NFTA_HOOK_PRIORITY, priority.to_be_bytes().to_vec()),
            ]);
            messages.push(NftMessage {
                kind: NFT_MSG_NEWCHAIN,
                flags: libc::NLM_F_CREATE as u16,
                family,
                attrs: vec![
                    string(NFTA_CHAIN_TABLE, name),
                    string(NFTA_CHAIN_NAME, chain),
                    (NFTA_CHAIN_HOOK | NLA_F_NESTED, hook),
                    (NFTA_CHAIN_POLICY, NF_ACCEPT.to_be_bytes().to_vec()),
                    string(NFTA_CHAIN_TYPE, "nat"),
                ],
                what: format!("adding chain inet {name} {chain}"),
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
                    string(NFTA_RULE_TABLE, name),
                    string(NFTA_RULE_CHAIN, chain),
                    (
                        NFTA_RULE_EXPRESSIONS | NLA_F_NESTED,
                        nested(&[(NFTA_LIST_ELEM | NLA_F_NESTED, expression)]),
                    ),
                ],
                what: format!("adding a rule to chain inet {name} {chain}"),
            });
        }
        self.commit(messages)
    }

    /// Whether the ipset `name` exists.
    pub(in crate::datapath) fn ipset_exists(&mut self, name: &str) -> io::Result<bool> {
        self.ipset(IPSET_CMD_HEADER, name)
    }

    /// Destroys the ipset `name`; returns whether there was one. A set a rule still uses cannot
    /// be destroyed: [`io::ErrorKind::ResourceBusy`].
    pub(in crate::datapath) fn destroy_ipset(&mut self, name: &str) -> io::Result<bool> {
        self.ipset(IPSET_CMD_DESTROY, name).map_err(|error| {
            match error.raw_os_error() {
                Some(IPSET_ERR_BUSY) => io::Error::new(
                    io::ErrorKind::ResourceBusy,
                    format!("ipset {name} is in use by a rule weir does not remove (iptables-legacy's?)"),
                ),
                _ => io::Error::new(error.kind(), format!("destroying ipset {name}: {error}")),
            }
        })
    }

    /// Runs ipset `command` on the set `name`: true once acknowledged, false where no such set
    /// is (or no ipset in this kernel: nfnetlink answers EINVAL for a subsystem it lacks).
    fn ipset(&mut self, command: u16, name: &str) -> io::Result<bool> {
        let sequence = self.next_sequence();
        let mut request = Vec::new();
        push_message(
            &mut request,
            (NFNL_SUBSYS_IPSET << 8) | command,
            // Without NLM_F_EXCL ipset takes a missing set as done (`ipset -exist`).
            (libc::NLM_F_ACK | libc::NLM_F_EXCL) as u16,
            sequence,
            (libc::NFPROTO_IPV4 as u8, 0),
            &[
                (IPSET_ATTR_PROTOCOL, vec![IPSET_PROTOCOL]),
                string(IPSET_ATTR_SETNAME, name),
            ],
        );
        self.socket.send(&request, 0)?;
        loop {
            for (kind, message_sequence, payload) in netlink_messages(self.recv()?) {
                if kind != NLMSG_ERROR || message_sequence != sequence {
                    continue;
                }
                return match -error_code(payload) {
                    0 => Ok(true),
                    libc::ENOENT | libc::EINVAL => Ok(false),
                    errno => Err(io::Error::from_raw_os_error(errno)),
                };
            }
        }
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
