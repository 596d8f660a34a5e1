//! One subscription, in the node's netns, to the link and address changes of every pod's
//! namespace, each change tagged with the id the node's netns has for the pod's.
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_route::{nsid::NsidAttribute, nsid::NsidMessage, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::transport::Rtnl;

/// A non-blocking socket in the current netns (the node's) that receives every link and address
/// change (`RTNLGRP_LINK`, `RTNLGRP_IPV4_IFADDR`, `RTNLGRP_IPV6_IFADDR`), and route changes once
/// [`follow_route_changes`] asks for them, of every netns that has an id here
/// (`NETLINK_LISTEN_ALL_NSID`), each tagged with that id ([`recv_change`]).
/// Its messages only say that something changed; an overflow (`ENOBUFS`) says the same of
/// everything. One socket for every pod: every rtnetlink notification on the node walks every
/// socket subscribed to rtnetlink groups, in any netns, so a socket per pod would make each of
/// them (and each of weir's own netlink changes) cost O(pods).
pub fn subscribe_interface_changes() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    let groups = libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR;
    socket.bind(&SocketAddr::new(0, groups as u32))?;
    socket.set_listen_all_namespaces(true)?;
    // A reboot storm's changes from thousands of pods at once: fewer overflows.
    socket.set_rx_buf_sz(CHANGES_RECV_BUFFER)?;
    socket.set_non_blocking(true)?;
    Ok(socket)
}

const CHANGES_RECV_BUFFER: usize = 4 << 20;

/// Makes a [`subscribe_interface_changes`] socket (`socket`, or a duplicate of its fd) receive
/// route changes too (`RTNLGRP_IPV4_ROUTE`, `RTNLGRP_IPV6_ROUTE`) when `on`, or no longer.
/// Only while a followed pod's capture depends on its routes: for each change the socket
/// receives from another netns, the kernel looks that netns' id up among all of the node's ids,
/// one per pod, and route changes are the most frequent (weir's own enrollments make some).
pub fn follow_route_changes(socket: BorrowedFd<'_>, on: bool) -> io::Result<()> {
    let option = match on {
        true => libc::NETLINK_ADD_MEMBERSHIP,
        false => libc::NETLINK_DROP_MEMBERSHIP,
    };
    for group in [libc::RTNLGRP_IPV4_ROUTE, libc::RTNLGRP_IPV6_ROUTE] {
        let group = group as libc::c_int;
        // SAFETY: a valid fd and a c_int option value of the size passed.
        let result = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_NETLINK,
                option,
                std::ptr::from_ref(&group).cast(),
                size_of_val(&group) as libc::socklen_t,
            )
        };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// One change a [`subscribe_interface_changes`] socket heard of.
pub struct Change {
    /// The id of the netns it happened in, `None` for the socket's own netns.
    pub namespace_id: Option<i32>,
    /// A route's change, which only pods whose routes decide their capture follow.
    pub route: bool,
}

/// Receives one datagram from a [`subscribe_interface_changes`] socket, its content discarded
/// but its message type (only the wake-up matters).
pub fn recv_change(socket: &impl AsRawFd) -> io::Result<Change> {
    let mut discard = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: discard.as_mut_ptr().cast(),
        iov_len: discard.len(),
    };
    // u64s: a control buffer aligned as `cmsghdr` wants.
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = size_of_val(&control);
    // SAFETY: `header` points at live buffers of the sizes it states.
    if unsafe { libc::recvmsg(socket.as_raw_fd(), &mut header, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // `nlmsg_type`, after the 32-bit length; a notification is one message.
    let kind = u16::from_ne_bytes([discard[4], discard[5]]);
    let route = matches!(kind, libc::RTM_NEWROUTE | libc::RTM_DELROUTE);
    // SAFETY: the kernel filled `header`'s control buffer; the CMSG macros stay within it.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&header) };
    while !cmsg.is_null() {
        // SAFETY: non-null, within the control buffer.
        let (level, kind) = unsafe { ((*cmsg).cmsg_level, (*cmsg).cmsg_type) };
        if level == libc::SOL_NETLINK && kind == libc::NETLINK_LISTEN_ALL_NSID {
            // SAFETY: this message's data is the sender's netns id, an int.
            let id = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>()) };
            return Ok(Change {
                namespace_id: Some(id),
                route,
            });
        }
        // SAFETY: as above.
        cmsg = unsafe { libc::CMSG_NXTHDR(&header, cmsg) };
    }
    Ok(Change {
        namespace_id: None,
        route,
    })
}

impl Rtnl {
    /// The id this socket's netns has for the netns `netns` (an fd of it), assigned now if it
    /// has none yet (`RTM_GETNSID`, then `RTM_NEWNSID`). Ids are what
    /// [`subscribe_interface_changes`] tags other namespaces' changes with.
    pub fn namespace_id(&mut self, netns: BorrowedFd<'_>) -> io::Result<i32> {
        let fd = NsidAttribute::Fd(netns.as_raw_fd() as u32);
        for _ in 0..2 {
            let mut query = NsidMessage::default();
            query.attributes.push(fd.clone());
            if let RouteNetlinkMessage::NewNsId(reply) =
                self.request(RouteNetlinkMessage::GetNsId(query))?
            {
                let id = reply
                    .attributes
                    .iter()
                    .find_map(|attribute| match attribute {
                        NsidAttribute::Id(id) if *id >= 0 => Some(*id),
                        _ => None,
                    });
                if let Some(id) = id {
                    return Ok(id);
                }
            }
            let mut assign = NsidMessage::default();
            // -1: any free id.
            assign
                .attributes
                .extend([fd.clone(), NsidAttribute::Id(-1)]);
            let errno = self.execute(vec![(RouteNetlinkMessage::NewNsId(assign), 0)])?[0];
            if errno != 0 && errno != libc::EEXIST {
                return Err(io::Error::from_raw_os_error(errno));
            }
        }
        Err(io::Error::other("the netns got no id"))
    }
}
