//! The socket: requests batched into one datagram with only the last acknowledged, dumps
//! retried when they raced with a change, single requests with a reply.
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

/// Room for one datagram of a dump: the kernel fills at most 32 KiB per `recv`.
const RECV_BUFFER: usize = 32 * 1024;

/// One rtnetlink socket, in the network namespace of the thread that made it.
pub struct Rtnl {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl AsFd for Rtnl {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }
}

impl Rtnl {
    /// A socket in the calling thread's current network namespace.
    pub fn new() -> io::Result<Self> {
        let socket = Socket::new(NETLINK_ROUTE)?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends all `messages` in one datagram, each with `NLM_F_REQUEST` and its own flags, and
    /// returns each one's errno (0 for success), in order. Only the last asks for an ACK: the
    /// kernel answers every failed request anyway and handles a datagram's requests in order
    /// before the send returns, so the last one's answer comes after every other's. That saves
    /// a `recv` per successful request.
    pub(super) fn execute(
        &mut self,
        messages: Vec<(RouteNetlinkMessage, u16)>,
    ) -> io::Result<Vec<i32>> {
        let first = self.sequence.wrapping_add(1);
        let mut datagram = Vec::new();
        let count = messages.len();
        for (index, (message, flags)) in messages.into_iter().enumerate() {
            let ack = if index + 1 == count { NLM_F_ACK } else { 0 };
            self.append(&mut datagram, message, NLM_F_REQUEST | ack | flags);
        }
        self.socket.send(&datagram, 0)?;

        let mut errnos = vec![0; count];
        loop {
            for reply in self.recv()? {
                let NetlinkPayload::Error(error) = reply.payload else {
                    continue;
                };
                let index = reply.header.sequence_number.wrapping_sub(first) as usize;
                if let Some(slot) = errnos.get_mut(index) {
                    // The kernel reports -errno; 0 is the plain ACK.
                    *slot = -error.raw_code();
                    if index + 1 == count {
                        return Ok(errnos);
                    }
                }
            }
        }
    }

    /// Every reply to a `NLM_F_DUMP` request. A dump that raced with a change (`NLM_F_DUMP_INTR`)
    /// may be inconsistent and is retried.
    pub(super) fn dump(
        &mut self,
        request: RouteNetlinkMessage,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        for _ in 0..3 {
            let mut datagram = Vec::new();
            self.append(&mut datagram, request.clone(), NLM_F_REQUEST | NLM_F_DUMP);
            self.socket.send(&datagram, 0)?;

            let mut replies = Vec::new();
            let mut interrupted = false;
            'dump: loop {
                for reply in self.recv()? {
                    if reply.header.sequence_number != self.sequence {
                        continue;
                    }
                    interrupted |= reply.header.flags & NLM_F_DUMP_INTR != 0;
                    match reply.payload {
                        NetlinkPayload::InnerMessage(message) => replies.push(message),
                        NetlinkPayload::Done(_) => break 'dump,
                        NetlinkPayload::Error(error) if error.code.is_some() => {
                            return Err(error.to_io())
                        }
                        _ => {}
                    }
                }
            }
            if !interrupted {
                return Ok(replies);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::Interrupted,
            "netlink dump kept changing underneath",
        ))
    }

    fn append(&mut self, datagram: &mut Vec<u8>, message: RouteNetlinkMessage, flags: u16) {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.sequence;
        let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        message.finalize();
        let start = datagram.len();
        // Messages in one datagram start on 4-byte boundaries (NLMSG_ALIGN).
        datagram.resize(start + message.buffer_len().next_multiple_of(4), 0);
        message.serialize(&mut datagram[start..]);
    }

    /// Sends one request and returns its reply.
    pub(super) fn request(
        &mut self,
        message: RouteNetlinkMessage,
    ) -> io::Result<RouteNetlinkMessage> {
        let mut datagram = Vec::new();
        self.append(&mut datagram, message, NLM_F_REQUEST);
        self.socket.send(&datagram, 0)?;
        loop {
            for reply in self.recv()? {
                if reply.header.sequence_number != self.sequence {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::InnerMessage(message) => return Ok(message),
                    NetlinkPayload::Error(error) if error.code.is_some() => {
                        return Err(error.to_io())
                    }
                    _ => {}
                }
            }
        }
    }

    /// The messages of the next datagram.
    fn recv(&mut self) -> io::Result<Vec<NetlinkMessage<RouteNetlinkMessage>>> {
        self.buffer.clear();
        // MSG_TRUNC: the return value is the datagram's full length, so truncation shows.
        let len = self.socket.recv(&mut self.buffer, libc::MSG_TRUNC)?;
        if len > self.buffer.len() {
            return Err(io::Error::other(format!(
                "netlink reply of {len} bytes truncated"
            )));
        }
        let mut messages = Vec::new();
        let mut rest = &self.buffer[..];
        while !rest.is_empty() {
            let message = NetlinkMessage::deserialize(rest)
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
            let len = (message.header.length as usize).next_multiple_of(4);
            rest = rest.get(len..).unwrap_or_default();
            messages.push(message);
        }
        Ok(messages)
    }
}
