//! The socket options ztunnel's in-pod sockets use, and its original-destination lookup.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd};

use socket2::{Domain, SockAddr, SockRef};

pub use crate::netns::netns_cookie;

/// `SO_ORIGINAL_DST` (`SOL_IP`) and `IP6T_SO_ORIGINAL_DST` (`SOL_IPV6`) share the number.
pub const SO_ORIGINAL_DST: libc::c_int = 80;

/// ztunnel's lookup of where a redirected connection was going (`socket::orig_dst_addr`):
/// `getsockopt(SOL_IP, SO_ORIGINAL_DST)`, then `(SOL_IPV6, SO_ORIGINAL_DST)`, both into a
/// `sockaddr_storage` (so `optlen` is 128, as weir's getsockopt hook sees from ztunnel). `None`
/// when both fail: ztunnel then uses the accepted socket's local address. Canonical (a v4-mapped
/// answer becomes IPv4).
pub fn original_dst(socket: &impl AsFd) -> Option<SocketAddr> {
    original_dst_at(socket, libc::SOL_IP)
        .or_else(|_| original_dst_at(socket, libc::SOL_IPV6))
        .ok()
        .map(canonical)
}

fn original_dst_at(socket: &impl AsFd, level: libc::c_int) -> io::Result<SocketAddr> {
    // SAFETY: `try_init` hands over a zeroed sockaddr_storage and its size (128) as the length;
    // getsockopt writes at most that many bytes and stores the length it wrote.
    let ((), addr) = unsafe {
        SockAddr::try_init(|storage, len| {
            let rc = libc::getsockopt(
                socket.as_fd().as_raw_fd(),
                level,
                SO_ORIGINAL_DST,
                storage.cast(),
                len,
            );
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        })?
    };
    addr.as_socket()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not an IP address"))
}

/// ztunnel's `to_canonical`: an IPv4-mapped IPv6 address (what dual-stack sockets report for IPv4
/// peers) as the IPv4 address it is.
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// `SO_MARK`: ztunnel marks every socket it makes in a pod; redirection leaves marked traffic alone.
pub fn set_mark(socket: &impl AsFd, mark: u32) -> io::Result<()> {
    SockRef::from(socket).set_mark(mark)
}

/// `IP_TRANSPARENT` and, on IPv6 sockets, `IPV6_TRANSPARENT` too (the kernel keeps one flag for
/// both; ztunnel sets the one of the socket's family): lets a listener take connections for
/// addresses that are not local, and a dialing socket bind to one (another pod's address).
pub fn set_transparent(socket: &impl AsFd) -> io::Result<()> {
    let socket = SockRef::from(socket);
    socket.set_ip_transparent_v4(true)?;
    if socket.domain()? == Domain::IPV6 {
        socket.set_ip_transparent_v6(true)?;
    }
    Ok(())
}

/// `IP_FREEBIND` / `IPV6_FREEBIND`, by the socket's family: bind to an address this namespace
/// does not have.
pub fn set_freebind(socket: &impl AsFd) -> io::Result<()> {
    let socket = SockRef::from(socket);
    if socket.domain()? == Domain::IPV6 {
        socket.set_freebind_v6(true)
    } else {
        socket.set_freebind_v4(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_unmaps_v4() {
        let mapped: SocketAddr = "[::ffff:10.244.1.2]:80".parse().unwrap();
        assert_eq!(canonical(mapped), "10.244.1.2:80".parse().unwrap());
        let v6: SocketAddr = "[fd00::2]:80".parse().unwrap();
        assert_eq!(canonical(v6), v6);
    }
}
