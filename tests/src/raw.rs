//! Hand-made TCP SYNs, sent from a pod with raw sockets, as an attacker in another pod would send
//! them: whole, with IPv4 options, behind IPv6 extension headers, or split into IP fragments, with
//! other flags beside SYN or a wrong checksum. The replies are caught with a raw socket too, so a
//! test sees who answered (a SYN-ACK, a RST, and the MSS a SYN-ACK offers) or that nothing did.
//!
//! Run [`probe`] inside the attacking pod (`pod.run(|| probe(..))`): it sends every SYN, then
//! collects the answers for a while.

use std::collections::HashMap;
use std::io;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

const IPPROTO_TCP: u8 = 6;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_DSTOPTS: u8 = 60;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_ACK: u8 = 0x10;
pub const TCP_URG: u8 = 0x20;
pub const TCP_ECE: u8 = 0x40;
pub const TCP_CWR: u8 = 0x80;
const TCP_OPTION_END: u8 = 0;
const TCP_OPTION_NOP: u8 = 1;
const TCP_OPTION_MSS: u8 = 2;
const IPV4_MORE_FRAGMENTS: u16 = 0x2000;

/// How a SYN is put on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One packet, nothing unusual.
    Whole,
    /// IPv4 only: a header with 4 bytes of options (NOPs), IHL 6.
    Ipv4Options,
    /// IPv6 only: behind these extension headers (Hop-by-Hop, Destination Options), in order.
    Ipv6Extensions(&'static [u8]),
    /// Two fragments, the first carrying this many bytes of the TCP header (a multiple of 8).
    Fragmented(usize),
    /// One packet in an Ethernet frame sent on the pod's `eth0` (a packet socket, as a pod with
    /// CAP_NET_RAW can) to this MAC address, behind VLAN tags with id 0 of these types,
    /// outermost first.
    VlanTagged(&'static [u16], [u8; 6]),
}

/// A SYN to send: from the pod's `source` address, to `destination`.
#[derive(Clone, Copy, Debug)]
pub struct Syn {
    pub source: SocketAddr,
    pub destination: SocketAddr,
    pub shape: Shape,
    pub tcp: Tcp,
}

/// The segment's own header: its flags, and whether its checksum is right.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tcp {
    pub flags: u8,
    pub checksum_valid: bool,
}

impl Tcp {
    /// A plain SYN, as a real client sends it.
    pub const SYN: Self = Self {
        flags: TCP_SYN,
        checksum_valid: true,
    };
}

/// What came back for one SYN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    SynAck,
    Reset,
    Nothing,
}

/// What came back for one SYN, with the maximum segment size a SYN-ACK offered: the answering
/// listener's `TCP_MAXSEG` where it set one below the route's, which tells who answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub answer: Answer,
    pub mss: Option<u16>,
}

pub use Shape::*;

/// VLAN tag types: 802.1Q, and 802.1ad (an outer, service tag).
pub const VLAN: u16 = 0x8100;
pub const QINQ: u16 = 0x88a8;

/// The IPv6 extension headers tests put before TCP.
pub const HOP_BY_HOP: &[u8] = &[IPPROTO_HOPOPTS];
pub const DESTINATION_OPTIONS: &[u8] = &[IPPROTO_DSTOPTS];
pub const HOP_BY_HOP_AND_DESTINATION_OPTIONS: &[u8] = &[IPPROTO_HOPOPTS, IPPROTO_DSTOPTS];

/// Sends every SYN (each from its own source port), then waits `window` for the answers.
/// Runs in the sending pod's netns.
pub fn probe(syns: &[Syn], window: Duration) -> io::Result<Vec<Answer>> {
    Ok(probe_replies(syns, window)?
        .into_iter()
        .map(|reply| reply.answer)
        .collect())
}

/// [`probe`], with each SYN-ACK's maximum segment size.
pub fn probe_replies(syns: &[Syn], window: Duration) -> io::Result<Vec<Reply>> {
    // Open the catchers before anything is sent, so no answer is missed.
    let catchers = [catcher(Domain::IPV4)?, catcher(Domain::IPV6)?];
    for (index, syn) in syns.iter().enumerate() {
        let id = 0x5700 + index as u32;
        for packet in packets(syn, id) {
            match syn.shape {
                VlanTagged(tags, mac) => {
                    send_frame(&frame_socket()?, &frame(tags, mac, &packet), mac)?
                }
                _ => sender(syn.destination)?
                    .send_to(&packet, &SocketAddr::new(syn.destination.ip(), 0).into())?,
            };
        }
    }
    let mut replies: HashMap<(SocketAddr, u16), Reply> = HashMap::new();
    let deadline = Instant::now() + window;
    while Instant::now() < deadline {
        for (catcher, v6) in catchers.iter().zip([false, true]) {
            while let Some(caught) = receive(catcher, v6)? {
                let answer = if caught.flags & (TCP_SYN | TCP_ACK) == TCP_SYN | TCP_ACK {
                    Answer::SynAck
                } else if caught.flags & TCP_RST != 0 {
                    Answer::Reset
                } else {
                    continue;
                };
                let reply = Reply {
                    answer,
                    mss: caught.mss,
                };
                replies
                    .entry((caught.from, caught.to_port))
                    .or_insert(reply);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(syns
        .iter()
        .map(|syn| {
            let key = (syn.destination, syn.source.port());
            replies.get(&key).copied().unwrap_or(Reply {
                answer: Answer::Nothing,
                mss: None,
            })
        })
        .collect())
}

/// A TCP segment a catcher saw.
struct Caught {
    from: SocketAddr,
    to_port: u16,
    flags: u8,
    mss: Option<u16>,
}

/// A raw socket that receives a copy of every TCP packet arriving in this netns.
fn catcher(domain: Domain) -> io::Result<Socket> {
    let socket = Socket::new(domain, Type::RAW, Some(Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// A raw socket whose writes are whole IP packets (`IPPROTO_RAW` implies `IP(V6)_HDRINCL`).
fn sender(destination: SocketAddr) -> io::Result<Socket> {
    Socket::new(
        Domain::for_address(destination),
        Type::RAW,
        Some(Protocol::from(libc::IPPROTO_RAW)),
    )
}

/// An Ethernet frame carrying `packet` behind VLAN tags with id 0 (priority tags) of the types in
/// `tags`, from a locally administered address.
fn frame(tags: &[u16], to: [u8; 6], packet: &[u8]) -> Vec<u8> {
    let mut frame = to.to_vec();
    frame.extend_from_slice(&[0x02, 0, 0, 0, 0x57, 0x01]);
    for tag in tags {
        frame.extend_from_slice(&tag.to_be_bytes());
        frame.extend_from_slice(&0u16.to_be_bytes());
    }
    let ethertype: u16 = if packet[0] >> 4 == 6 { 0x86dd } else { 0x0800 };
    frame.extend_from_slice(&ethertype.to_be_bytes());
    frame.extend_from_slice(packet);
    frame
}

/// Sends each SYN once, whole, in an Ethernet frame on this netns's `eth0` addressed to `to`,
/// without waiting for answers: a flood. Runs in the sending pod's netns.
pub fn flood(syns: impl IntoIterator<Item = Syn>, to: [u8; 6]) -> io::Result<usize> {
    let socket = frame_socket()?;
    let mut sent = 0;
    for syn in syns {
        for packet in packets(&syn, sent as u32) {
            send_frame(&socket, &frame(&[], to, &packet), to)?;
        }
        sent += 1;
    }
    Ok(sent)
}

fn frame_socket() -> io::Result<Socket> {
    Socket::new(Domain::PACKET, Type::RAW, None)
}

/// Sends a whole frame on this netns's `eth0`.
fn send_frame(socket: &Socket, frame: &[u8], to: [u8; 6]) -> io::Result<usize> {
    let interface = nix::net::if_::if_nametoindex("eth0")?;
    // SAFETY: an all-zero sockaddr_ll is valid; the fields set below describe the link.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_ifindex = interface as i32;
    address.sll_halen = 6;
    address.sll_addr[..6].copy_from_slice(&to);
    // SAFETY: `address` is a sockaddr_ll and its size is given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&raw const address).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// The next caught segment, if any is queued.
fn receive(socket: &Socket, v6: bool) -> io::Result<Option<Caught>> {
    let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
    let (len, from) = match socket.recv_from(&mut buf) {
        Ok(received) => received,
        Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(None),
        Err(error) => return Err(error),
    };
    // SAFETY: the kernel initialised the first `len` bytes.
    let bytes: Vec<u8> = buf[..len]
        .iter()
        .map(|b| unsafe { b.assume_init() })
        .collect();
    // An IPv4 raw socket gets the IP header; an IPv6 one gets the TCP segment alone.
    let tcp = if v6 {
        &bytes[..]
    } else {
        &bytes[usize::from(bytes[0] & 0x0f) * 4..]
    };
    if tcp.len() < 14 {
        return Ok(None);
    }
    let ip = from
        .as_socket()
        .map(|addr| addr.ip().to_canonical())
        .ok_or_else(|| io::Error::other("raw socket answered no address"))?;
    Ok(Some(Caught {
        from: SocketAddr::new(ip, u16::from_be_bytes([tcp[0], tcp[1]])),
        to_port: u16::from_be_bytes([tcp[2], tcp[3]]),
        flags: tcp[13],
        mss: mss_option(tcp),
    }))
}

/// The MSS option of a TCP segment (header and options), if it carries one.
fn mss_option(tcp: &[u8]) -> Option<u16> {
    let header_len = usize::from(tcp[12] >> 4) * 4;
    let mut options = tcp.get(20..header_len)?;
    while let [kind, rest @ ..] = options {
        match *kind {
            TCP_OPTION_END => return None,
            TCP_OPTION_NOP => options = rest,
            _ => {
                let len = usize::from(*rest.first()?);
                if len < 2 || options.len() < len {
                    return None;
                }
                if *kind == TCP_OPTION_MSS && len == 4 {
                    return Some(u16::from_be_bytes([options[2], options[3]]));
                }
                options = &options[len..];
            }
        }
    }
    None
}

/// The IP packets that make up `syn`: one, or two fragments.
pub fn packets(syn: &Syn, id: u32) -> Vec<Vec<u8>> {
    let segment = tcp_syn(syn, id);
    match (syn.source.ip(), syn.destination.ip()) {
        (IpAddr::V4(source), IpAddr::V4(destination)) => {
            let ipv4 = |flags_offset: u16, options: &[u8], payload: &[u8]| {
                ipv4_packet(
                    source.octets(),
                    destination.octets(),
                    id as u16,
                    flags_offset,
                    options,
                    payload,
                )
            };
            match syn.shape {
                Whole | VlanTagged(..) => vec![ipv4(0, &[], &segment)],
                Ipv4Options => vec![ipv4(0, &[1, 1, 1, 0], &segment)],
                Fragmented(first) => vec![
                    ipv4(IPV4_MORE_FRAGMENTS, &[], &segment[..first]),
                    ipv4((first / 8) as u16, &[], &segment[first..]),
                ],
                Ipv6Extensions(_) => panic!("extension headers are IPv6's"),
            }
        }
        (IpAddr::V6(source), IpAddr::V6(destination)) => {
            let ipv6 = |next_header: u8, payload: &[u8]| {
                ipv6_packet(source.octets(), destination.octets(), next_header, payload)
            };
            match syn.shape {
                Whole | VlanTagged(..) => vec![ipv6(IPPROTO_TCP, &segment)],
                Ipv6Extensions(headers) => {
                    // Each header is 8 bytes: next header, length 0, then a PadN option of 4.
                    let mut payload = Vec::new();
                    for (index, _) in headers.iter().enumerate() {
                        let next = headers.get(index + 1).copied().unwrap_or(IPPROTO_TCP);
                        payload.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
                    }
                    payload.extend_from_slice(&segment);
                    vec![ipv6(headers[0], &payload)]
                }
                Fragmented(first) => {
                    let fragment = |offset: usize, more: bool, data: &[u8]| {
                        let offset_flags = (offset as u16) << 3 | u16::from(more);
                        let mut payload = vec![IPPROTO_TCP, 0];
                        payload.extend_from_slice(&offset_flags.to_be_bytes());
                        payload.extend_from_slice(&id.to_be_bytes());
                        payload.extend_from_slice(data);
                        ipv6(IPPROTO_FRAGMENT, &payload)
                    };
                    vec![
                        fragment(0, true, &segment[..first]),
                        fragment(first / 8, false, &segment[first..]),
                    ]
                }
                Ipv4Options => panic!("IP options are IPv4's"),
            }
        }
        _ => panic!("source and destination families differ: {syn:?}"),
    }
}

/// A 32-byte SYN segment (MSS, SACK-permitted and window-scale options, as a real client's), with
/// its checksum (off by one where `syn.tcp` asks for a wrong one), and the flags of `syn.tcp`.
fn tcp_syn(syn: &Syn, sequence: u32) -> Vec<u8> {
    let mut segment = Vec::with_capacity(32);
    segment.extend_from_slice(&syn.source.port().to_be_bytes());
    segment.extend_from_slice(&syn.destination.port().to_be_bytes());
    segment.extend_from_slice(&sequence.to_be_bytes());
    segment.extend_from_slice(&0u32.to_be_bytes());
    segment.extend_from_slice(&[8 << 4, syn.tcp.flags]);
    segment.extend_from_slice(&64240u16.to_be_bytes());
    segment.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    segment.extend_from_slice(&[2, 4, 0x05, 0xb4, 4, 2, 1, 3, 3, 7, 1, 1]);
    let mut pseudo_header = Vec::new();
    match (syn.source.ip(), syn.destination.ip()) {
        (IpAddr::V4(source), IpAddr::V4(destination)) => {
            pseudo_header.extend_from_slice(&source.octets());
            pseudo_header.extend_from_slice(&destination.octets());
            pseudo_header.extend_from_slice(&[0, IPPROTO_TCP]);
            pseudo_header.extend_from_slice(&(segment.len() as u16).to_be_bytes());
        }
        (source, destination) => {
            pseudo_header.extend_from_slice(&v6_octets(source));
            pseudo_header.extend_from_slice(&v6_octets(destination));
            pseudo_header.extend_from_slice(&(segment.len() as u32).to_be_bytes());
            pseudo_header.extend_from_slice(&[0, 0, 0, IPPROTO_TCP]);
        }
    }
    let mut checksum = internet_checksum(&[pseudo_header.as_slice(), &segment].concat());
    if !syn.tcp.checksum_valid {
        checksum = checksum.wrapping_add(1);
    }
    segment[16..18].copy_from_slice(&checksum.to_be_bytes());
    segment
}

fn v6_octets(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V6(ip) => ip.octets(),
        IpAddr::V4(ip) => ip.to_ipv6_mapped().octets(),
    }
}

fn ipv4_packet(
    source: [u8; 4],
    destination: [u8; 4],
    id: u16,
    flags_offset: u16,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let header_len = 20 + options.len();
    let mut packet = Vec::with_capacity(header_len + payload.len());
    packet.push(0x40 | (header_len / 4) as u8);
    packet.push(0);
    packet.extend_from_slice(&((header_len + payload.len()) as u16).to_be_bytes());
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&flags_offset.to_be_bytes());
    packet.extend_from_slice(&[64, IPPROTO_TCP, 0, 0]);
    packet.extend_from_slice(&source);
    packet.extend_from_slice(&destination);
    packet.extend_from_slice(options);
    let checksum = internet_checksum(&packet);
    packet[10..12].copy_from_slice(&checksum.to_be_bytes());
    packet.extend_from_slice(payload);
    packet
}

fn ipv6_packet(
    source: [u8; 16],
    destination: [u8; 16],
    next_header: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut packet = Vec::with_capacity(40 + payload.len());
    packet.extend_from_slice(&[0x60, 0, 0, 0]);
    packet.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    packet.extend_from_slice(&[next_header, 64]);
    packet.extend_from_slice(&source);
    packet.extend_from_slice(&destination);
    packet.extend_from_slice(payload);
    packet
}

/// RFC 1071.
fn internet_checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|pair| u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify_to_zero() {
        let syn = Syn {
            source: "10.0.0.1:40000".parse().unwrap(),
            destination: "10.0.0.2:80".parse().unwrap(),
            shape: Whole,
            tcp: Tcp::SYN,
        };
        let packet = &packets(&syn, 7)[0];
        assert_eq!(internet_checksum(&packet[..20]), 0, "IPv4 header");
        let mut pseudo = vec![10, 0, 0, 1, 10, 0, 0, 2, 0, IPPROTO_TCP, 0, 32];
        pseudo.extend_from_slice(&packet[20..]);
        assert_eq!(internet_checksum(&pseudo), 0, "TCP segment");
    }

    #[test]
    fn the_mss_option_is_found_among_others() {
        let mut segment = vec![0u8; 20];
        segment[12] = 7 << 4;
        segment.extend_from_slice(&[TCP_OPTION_NOP, 4, 2, TCP_OPTION_MSS, 4, 0x02, 0x18]);
        segment.push(TCP_OPTION_END);
        assert_eq!(mss_option(&segment), Some(536));
        segment[12] = 5 << 4;
        assert_eq!(mss_option(&segment), None, "no options");
    }

    #[test]
    fn fragments_split_the_segment_at_the_asked_offset() {
        let syn = Syn {
            source: "[fd00::1]:40000".parse().unwrap(),
            destination: "[fd00::2]:80".parse().unwrap(),
            shape: Fragmented(24),
            tcp: Tcp::SYN,
        };
        let fragments = packets(&syn, 7);
        assert_eq!(fragments.len(), 2);
        // IPv6 header + fragment header + 24 bytes, then the other 8 at offset 3 (x 8 bytes).
        assert_eq!(fragments[0].len(), 40 + 8 + 24);
        assert_eq!(&fragments[0][42..44], &[0, 1], "offset 0, more fragments");
        assert_eq!(fragments[1].len(), 40 + 8 + 8);
        assert_eq!(&fragments[1][42..44], &[0, 3 << 3], "offset 3, last");
    }
}
