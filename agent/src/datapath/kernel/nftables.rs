//! A netlink client for nf_tables, ipset and conntrack (all under nfnetlink), as much of it as
//! weir needs to find, add and remove another agent's netfilter objects in a network namespace:
//! dumps of tables, chains and rules, transactions, ipset's header and destroy commands, and
//! conntrack entries for connections it never saw.
//!
//! Everything here works in the calling thread's network namespace.
use std::io;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

use super::connections::TcpConnection;

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
pub(super) const NLMSG_ERROR: u16 = 2;
pub(super) const NLMSG_DONE: u16 = 3;
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
// conntrack's (linux/netfilter/nfnetlink_conntrack.h, nf_conntrack_common.h,
// nf_conntrack_tcp.h).
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_NEW: u16 = 0;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_STATUS: u16 = 3;
const CTA_PROTOINFO: u16 = 4;
const CTA_TIMEOUT: u16 = 7;
const CTA_MARK: u16 = 8;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
const IPS_SEEN_REPLY: u32 = 1 << 1;
const IPS_ASSURED: u32 = 1 << 2;
/// Set by the kernel on an entry made over netlink before it reads the status given, which must
/// then keep it.
const IPS_CONFIRMED: u32 = 1 << 3;
const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;
/// conntrack's own timeout for an established TCP connection (`nf_conntrack_tcp_timeout_established`).
const CT_ESTABLISHED_TIMEOUT_SECS: u32 = 5 * 24 * 3600;
/// The set is referenced (by an iptables rule's `-m set`, or a `SET` target).
const IPSET_ERR_BUSY: i32 = 4100;
const NLMSG_HDRLEN: usize = 16;
/// Room for one datagram: the kernel fills at most 32 KiB per `recv`.
pub(super) const RECV_BUFFER: usize = 32 * 1024;

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
        let answer = self.request(
            (NFNL_SUBSYS_IPSET << 8) | command,
            // Without NLM_F_EXCL ipset takes a missing set as done (`ipset -exist`).
            libc::NLM_F_EXCL as u16,
            libc::NFPROTO_IPV4 as u8,
            &[
                (IPSET_ATTR_PROTOCOL, vec![IPSET_PROTOCOL]),
                string(IPSET_ATTR_SETNAME, name),
            ],
        );
        match answer {
            Ok(()) => Ok(true),
            Err(error) if matches!(error.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => {
                Ok(false)
            }
            Err(error) => Err(error),
        }
    }

    /// Gives conntrack `connection` as established, with the connection mark `connmark`, its
    /// window unchecked both ways (conntrack has not seen its start): its packets are then
    /// never a new connection to `nat` rules, which decide only a connection's first packet.
    /// Returns false where conntrack follows it already.
    pub(in crate::datapath) fn follow(
        &mut self,
        connection: &TcpConnection,
        connmark: u32,
    ) -> io::Result<bool> {
        let family = match connection.from {
            std::net::SocketAddr::V4(_) => libc::AF_INET as u8,
            std::net::SocketAddr::V6(_) => libc::AF_INET6 as u8,
        };
        let liberal = vec![IP_CT_TCP_FLAG_BE_LIBERAL, IP_CT_TCP_FLAG_BE_LIBERAL];
        let protoinfo = nested(&[(
            CTA_PROTOINFO_TCP | NLA_F_NESTED,
            nested(&[
                (CTA_PROTOINFO_TCP_STATE, vec![TCP_CONNTRACK_ESTABLISHED]),
                (CTA_PROTOINFO_TCP_FLAGS_ORIGINAL, liberal.clone()),
                (CTA_PROTOINFO_TCP_FLAGS_REPLY, liberal),
            ]),
        )]);
        let answer = self.request(
            (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW,
            (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16,
            family,
            &[
                (
                    CTA_TUPLE_ORIG | NLA_F_NESTED,
                    tuple(connection.from, connection.to),
                ),
                (
                    CTA_TUPLE_REPLY | NLA_F_NESTED,
                    tuple(connection.to, connection.from),
                ),
                (
                    CTA_STATUS,
                    (IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED)
                        .to_be_bytes()
                        .to_vec(),
                ),
                (
                    CTA_TIMEOUT,
                    CT_ESTABLISHED_TIMEOUT_SECS.to_be_bytes().to_vec(),
                ),
                (CTA_MARK, connmark.to_be_bytes().to_vec()),
                (CTA_PROTOINFO | NLA_F_NESTED, protoinfo),
            ],
        );
        match answer {
            Ok(()) => Ok(true),
            Err(error) if error.raw_os_error() == Some(libc::EEXIST) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// Sends one message and waits for its ack; the kernel's error otherwise.
    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        family: u8,
        attrs: &[(u16, Vec<u8>)],
    ) -> io::Result<()> {
        let sequence = self.next_sequence();
        let mut request = Vec::new();
        let flags = flags | libc::NLM_F_ACK as u16;
        push_message(&mut request, kind, flags, sequence, (family, 0), attrs);
        self.socket.send(&request, 0)?;
        loop {
            for (kind, message_sequence, payload) in netlink_messages(self.recv()?) {
                if kind != NLMSG_ERROR || message_sequence != sequence {
                    continue;
                }
                return match -error_code(payload) {
                    0 => Ok(()),
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

/// A conntrack tuple, `from` to `to`, TCP.
fn tuple(from: std::net::SocketAddr, to: std::net::SocketAddr) -> Vec<u8> {
    let addresses = match (from.ip(), to.ip()) {
        (std::net::IpAddr::V4(from), std::net::IpAddr::V4(to)) => vec![
            (CTA_IP_V4_SRC, from.octets().to_vec()),
            (CTA_IP_V4_DST, to.octets().to_vec()),
        ],
        (from, to) => vec![
            (CTA_IP_V6_SRC, ipv6_octets(from).to_vec()),
            (CTA_IP_V6_DST, ipv6_octets(to).to_vec()),
        ],
    };
    nested(&[
        (CTA_TUPLE_IP | NLA_F_NESTED, nested(&addresses)),
        (
            CTA_TUPLE_PROTO | NLA_F_NESTED,
            nested(&[
                (CTA_PROTO_NUM, vec![libc::IPPROTO_TCP as u8]),
                (CTA_PROTO_SRC_PORT, from.port().to_be_bytes().to_vec()),
                (CTA_PROTO_DST_PORT, to.port().to_be_bytes().to_vec()),
            ]),
        ),
    ])
}

fn ipv6_octets(address: std::net::IpAddr) -> [u8; 16] {
    match address {
        std::net::IpAddr::V4(address) => address.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(address) => address.octets(),
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
pub(super) fn error_code(payload: &[u8]) -> i32 {
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
pub(super) fn netlink_messages(mut datagram: &[u8]) -> impl Iterator<Item = (u16, u32, &[u8])> {
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
pub(super) fn attrs(mut bytes: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
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
