//! SOCK_SEQPACKET Unix sockets on tokio: the listener and one connection, whole datagrams with
//! or without a file descriptor (SCM_RIGHTS). tokio has no seqpacket type, so the sockets are
//! nix sockets registered with the reactor through [`AsyncFd`].

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nix::sys::socket::{
    accept4, bind, getsockopt, listen, recvmsg, sendmsg, socket, sockopt, AddressFamily, Backlog,
    ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr,
};
use tokio::io::unix::AsyncFd;

/// The largest datagram either side sends: ztunnel and istio read into 1024-byte buffers.
pub const MAX_DATAGRAM: usize = 1024;

/// Connections waiting to be accepted. ztunnel connects once (twice during an upgrade).
const BACKLOG: i32 = 16;

/// Binds and listens on `path`, readable and writable by root only: creates the parent
/// directory and removes a stale socket left by a previous run first (binding fails on an
/// existing file). Needs no runtime.
pub fn bind_listener(path: &Path) -> io::Result<OwnedFd> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => return Err(err),
        _ => {}
    }
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    // Whoever may connect may hand pods' network namespaces to a proxy of its own.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    listen(&fd, Backlog::new(BACKLOG)?)?;
    Ok(fd)
}

/// The file a socket was bound to, as (device, inode), to tell whether `path` still names it.
pub fn bound_file(path: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::symlink_metadata(path)?;
    Ok((metadata.dev(), metadata.ino()))
}

/// A listening seqpacket socket.
pub struct Listener(AsyncFd<OwnedFd>);

impl Listener {
    /// Registers `fd` (from [`bind_listener`]) with the current runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        register(fd).map(Self)
    }

    pub async fn accept(&self) -> io::Result<SeqpacketConnection> {
        let accepted = self
            .0
            .async_io(tokio::io::Interest::READABLE, |fd| {
                let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
                Ok(accept4(fd.as_raw_fd(), flags)?)
            })
            .await?;
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        SeqpacketConnection::new(unsafe { OwnedFd::from_raw_fd(accepted) })
    }
}

/// One datagram as received.
pub struct Datagram {
    pub bytes: Vec<u8>,
    /// The datagram did not fit [`MAX_DATAGRAM`] bytes (its tail was discarded), or it carried
    /// more descriptors than there was room for (the kernel closed the rest).
    pub truncated: bool,
    /// Descriptors that came with it, owned (closed on drop) so a misbehaving peer cannot make
    /// the agent leak them.
    pub fds: Vec<OwnedFd>,
}

impl Datagram {
    /// A zero-length read: on a seqpacket socket, the peer closed (or sent an empty datagram,
    /// which no ZDS message encodes to).
    pub fn is_eof(&self) -> bool {
        self.bytes.is_empty() && self.fds.is_empty() && !self.truncated
    }
}

/// A connected seqpacket socket.
pub struct SeqpacketConnection(AsyncFd<OwnedFd>);

impl SeqpacketConnection {
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        register(fd).map(Self)
    }

    /// The uid of the process that connected (its credentials when it called `connect`).
    pub fn peer_uid(&self) -> io::Result<u32> {
        let credentials = getsockopt(self.0.get_ref(), sockopt::PeerCredentials)?;
        Ok(credentials.uid())
    }

    /// The pid of the process that connected, in the agent's pid namespace (0 when it is not
    /// in there).
    pub fn peer_pid(&self) -> io::Result<u32> {
        let credentials = getsockopt(self.0.get_ref(), sockopt::PeerCredentials)?;
        Ok(u32::try_from(credentials.pid()).unwrap_or(0))
    }

    /// Sends `bytes` as one datagram, with `fd` attached when given.
    pub async fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        self.0
            .async_io(tokio::io::Interest::WRITABLE, |socket| {
                send_datagram(socket.as_fd(), bytes, fd)
            })
            .await
    }

    /// Receives one datagram. Cancel safe: the datagram is consumed only in the synchronous
    /// `recvmsg` after the socket turned readable.
    pub async fn recv(&self) -> io::Result<Datagram> {
        self.0
            .async_io(tokio::io::Interest::READABLE, |socket| {
                recv_datagram(socket.as_fd())
            })
            .await
    }
}

/// Registers `fd` with the current runtime's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is open and stays open, with the same number, until the `AsyncFd`
    // that owns it drops.
    Ok(unsafe { AsyncFd::register(fd) }?)
}

/// Sends `bytes` as one datagram (blocking on a blocking socket), with `fd` attached
/// (SCM_RIGHTS) when given.
pub fn send_datagram(
    socket: BorrowedFd<'_>,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let rights = fd.map(|fd| [fd.as_raw_fd()]);
    let cmsg = rights
        .as_ref()
        .map(|rights| ControlMessage::ScmRights(rights));
    // MSG_NOSIGNAL: a peer gone mid-send is EPIPE here, never a SIGPIPE.
    sendmsg::<()>(
        socket.as_raw_fd(),
        &[IoSlice::new(bytes)],
        cmsg.as_slice(),
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// Receives one datagram (blocking on a blocking socket) with the descriptors that came with it.
pub fn recv_datagram(socket: BorrowedFd<'_>) -> io::Result<Datagram> {
    let mut buf = vec![0; MAX_DATAGRAM];
    // Room for a few descriptors, so that a peer sending several is seen (and refused) rather
    // than only truncated.
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            // SAFETY: the kernel installed these descriptors for us; nothing else owns them.
            fds.extend(
                received
                    .into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    let len = msg.bytes;
    buf.truncate(len);
    Ok(Datagram {
        bytes: buf,
        truncated,
        fds,
    })
}
