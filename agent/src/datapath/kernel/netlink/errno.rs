//! What the kernel's answer to each change means: an object already as wanted (added before,
//! or already gone) is success, and so is an IPv6 object where IPv6 is off.
use std::io;

use netlink_packet_route::AddressFamily;

use super::objects::{Object, Op};
use super::transport::Rtnl;

impl Op {
    /// Whether `errno` means the object is already in the wanted state. Rules say ENOENT when
    /// gone, routes ESRCH, IPv6 addresses EADDRNOTAVAIL.
    fn settled(self, errno: i32) -> bool {
        match self {
            Op::Add => errno == libc::EEXIST,
            Op::Delete => matches!(errno, libc::ENOENT | libc::ESRCH | libc::EADDRNOTAVAIL),
        }
    }
}

impl Object {
    /// Whether `errno` says IPv6 is off here: `disable_ipv6` makes routes via and addresses on
    /// `lo` fail with EACCES; a kernel without IPv6 has no rules or routes for it (EAFNOSUPPORT).
    fn family_disabled(&self, errno: i32) -> bool {
        self.family() == AddressFamily::Inet6 && matches!(errno, libc::EACCES | libc::EAFNOSUPPORT)
    }
}

impl Rtnl {
    /// Applies every `(op, object)`, in order, in one round trip.
    pub(super) fn apply(
        &mut self,
        changes: impl IntoIterator<Item = (Op, Object)>,
    ) -> io::Result<()> {
        let changes: Vec<(Op, Object)> = changes.into_iter().collect();
        if changes.is_empty() {
            return Ok(());
        }
        let messages = changes
            .iter()
            .map(|(op, object)| (object.message(*op), object.flags(*op)))
            .collect();
        let errnos = self.execute(messages)?;
        for ((op, object), errno) in changes.iter().zip(errnos) {
            if errno == 0 || op.settled(errno) {
                continue;
            }
            if object.family_disabled(errno) {
                tracing::debug!("IPv6 is disabled in this network namespace: not {op} {object}");
                continue;
            }
            let err = io::Error::from_raw_os_error(errno);
            return Err(io::Error::new(err.kind(), format!("{op} {object}: {err}")));
        }
        Ok(())
    }
}
