//! Addresses as the kernel hands them to programs, converted to and from the ABI's `Endpoint`.
use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    programs::SockAddrContext,
};
use weir_common::{Endpoint, IpKey};

pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;
pub const SOCK_STREAM: u32 = 1;
pub const SOCK_DGRAM: u32 = 2;
pub const IPPROTO_TCP: u32 = 6;

/// Reads a context field with a volatile load. The verifier only accepts context accesses of the
/// form `*(ctx + constant)`; without this, LLVM may compute field addresses ahead of a branch and
/// dereference the merged pointer, which the verifier rejects ("dereference of modified ctx ptr").
macro_rules! ctx_read {
    ($ctx:expr, $($field:tt)+) => {
        ::core::ptr::read_volatile(::core::ptr::addr_of!((*$ctx).$($field)+))
    };
}
pub(crate) use ctx_read;

/// The two addresses of a socket-shaped context (`bpf_sock`, `bpf_sock_ops`), named by its IPv4
/// and IPv6 fields, as `Some((a, b))` for an IPv4 or IPv6 socket. Every field is loaded and the
/// family picks among the values afterwards: loads inside family branches let LLVM merge the field
/// addresses, and the verifier rejects a dereference of a computed context pointer.
macro_rules! socket_addresses {
    ($ctx:expr, ($a4:ident, $b4:ident), ($a6:ident, $b6:ident)) => {{
        let family = $crate::net::ctx_read!($ctx, family);
        let v4 = (
            $crate::net::ctx_read!($ctx, $a4),
            $crate::net::ctx_read!($ctx, $b4),
        );
        let a6 = [
            $crate::net::ctx_read!($ctx, $a6[0]),
            $crate::net::ctx_read!($ctx, $a6[1]),
            $crate::net::ctx_read!($ctx, $a6[2]),
            $crate::net::ctx_read!($ctx, $a6[3]),
        ];
        let b6 = [
            $crate::net::ctx_read!($ctx, $b6[0]),
            $crate::net::ctx_read!($ctx, $b6[1]),
            $crate::net::ctx_read!($ctx, $b6[2]),
            $crate::net::ctx_read!($ctx, $b6[3]),
        ];
        match family {
            $crate::net::AF_INET => Some((
                $crate::net::ip_from_v4_word(v4.0),
                $crate::net::ip_from_v4_word(v4.1),
            )),
            $crate::net::AF_INET6 => Some((
                $crate::net::ip_from_v6_words(a6),
                $crate::net::ip_from_v6_words(b6),
            )),
            _ => None,
        }
    }};
}
pub(crate) use socket_addresses;

/// `struct sockaddr_in`, for `bpf_bind` and the `SO_ORIGINAL_DST` answer.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SockaddrIn {
    family: u16,
    /// Network order.
    port: u16,
    addr: [u8; 4],
    zero: [u8; 8],
}

impl SockaddrIn {
    /// `ip` is IPv4-mapped; `port` in host order.
    #[inline(always)]
    pub fn new(ip: &IpKey, port: u16) -> Self {
        let o = &ip.octets;
        Self {
            family: AF_INET as u16,
            port: port.to_be(),
            addr: [o[12], o[13], o[14], o[15]],
            zero: [0; 8],
        }
    }
}

/// `struct sockaddr_in6`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SockaddrIn6 {
    family: u16,
    /// Network order.
    port: u16,
    flowinfo: u32,
    addr: [u8; 16],
    scope_id: u32,
}

impl SockaddrIn6 {
    /// `port` in host order.
    #[inline(always)]
    pub fn new(ip: &IpKey, port: u16) -> Self {
        Self {
            family: AF_INET6 as u16,
            port: port.to_be(),
            flowinfo: 0,
            addr: ip.octets,
            scope_id: 0,
        }
    }
}

/// Program return codes for cgroup hooks: 1 lets the operation proceed, 0 refuses it (EPERM).
pub const ALLOW: i32 = 1;
pub const DENY: i32 = 0;

#[inline(always)]
pub fn ip_from_v4_word(word: u32) -> IpKey {
    IpKey::from_v4(word.to_ne_bytes())
}

#[inline(always)]
pub fn ip_from_v6_words(words: [u32; 4]) -> IpKey {
    let mut octets = [0u8; 16];
    let mut i = 0;
    while i < 4 {
        let bytes = words[i].to_ne_bytes();
        octets[i * 4] = bytes[0];
        octets[i * 4 + 1] = bytes[1];
        octets[i * 4 + 2] = bytes[2];
        octets[i * 4 + 3] = bytes[3];
        i += 1;
    }
    IpKey::from_v6(octets)
}

#[inline(always)]
pub fn v6_words(ip: &IpKey) -> [u32; 4] {
    let o = &ip.octets;
    [
        u32::from_ne_bytes([o[0], o[1], o[2], o[3]]),
        u32::from_ne_bytes([o[4], o[5], o[6], o[7]]),
        u32::from_ne_bytes([o[8], o[9], o[10], o[11]]),
        u32::from_ne_bytes([o[12], o[13], o[14], o[15]]),
    ]
}

#[inline(always)]
pub fn is_v4_mapped(ip: &IpKey) -> bool {
    let o = &ip.octets;
    u32::from_ne_bytes([o[0], o[1], o[2], o[3]]) == 0
        && u32::from_ne_bytes([o[4], o[5], o[6], o[7]]) == 0
        && o[8] == 0
        && o[9] == 0
        && o[10] == 0xff
        && o[11] == 0xff
}

/// Word-wise, because byte-array equality becomes a `memcmp` call, which BPF has not.
#[inline(always)]
pub fn same_ip(a: &IpKey, b: &IpKey) -> bool {
    let (a, b) = (v6_words(a), v6_words(b));
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}

/// 127.0.0.0/8 (v4 or v4-mapped) and ::1.
#[inline(always)]
pub fn is_loopback(ip: &IpKey) -> bool {
    let o = &ip.octets;
    if is_v4_mapped(ip) {
        return o[12] == 127;
    }
    let words = v6_words(ip);
    words[0] == 0
        && words[1] == 0
        && words[2] == 0
        && o[12] == 0
        && o[13] == 0
        && o[14] == 0
        && o[15] == 1
}

/// The loopback address of the same family as `like`: where ztunnel's DNS proxy listens.
#[inline(always)]
pub fn loopback_like(like: &IpKey) -> IpKey {
    if is_v4_mapped(like) {
        IpKey::from_v4([127, 0, 0, 1])
    } else {
        let mut octets = [0u8; 16];
        octets[15] = 1;
        IpKey::from_v6(octets)
    }
}

/// A `bpf_sock_addr` context (connect, sendmsg, recvmsg, getpeername) of either family. For v4
/// hooks `user_ip4` holds the address; for v6 hooks `user_ip6` (IPv4-mapped for v4 peers).
pub struct SockAddr {
    pub ctx: *mut bpf_sock_addr,
    pub v6: bool,
}

impl SockAddr {
    /// The context of a `*4` hook.
    #[inline(always)]
    pub fn v4(ctx: &SockAddrContext) -> Self {
        Self {
            ctx: ctx.sock_addr,
            v6: false,
        }
    }

    /// The context of a `*6` hook.
    #[inline(always)]
    pub fn v6(ctx: &SockAddrContext) -> Self {
        Self {
            ctx: ctx.sock_addr,
            v6: true,
        }
    }

    /// The address the app named (connect/sendmsg), or the peer it is shown (getpeername/recvmsg).
    #[inline(always)]
    pub fn user_endpoint(&self) -> Endpoint {
        // SAFETY: the context pointer is valid for the program's run.
        unsafe {
            let ip = if self.v6 {
                ip_from_v6_words([
                    ctx_read!(self.ctx, user_ip6[0]),
                    ctx_read!(self.ctx, user_ip6[1]),
                    ctx_read!(self.ctx, user_ip6[2]),
                    ctx_read!(self.ctx, user_ip6[3]),
                ])
            } else {
                ip_from_v4_word(ctx_read!(self.ctx, user_ip4))
            };
            Endpoint::new(ip, u16::from_be(ctx_read!(self.ctx, user_port) as u16))
        }
    }

    /// Rewrites the user address. Each field is written on its own with a volatile store: LLVM
    /// otherwise merges adjacent 4-byte context stores into one 8-byte store the verifier rejects.
    #[inline(always)]
    pub fn set_user_endpoint(&self, endpoint: &Endpoint) {
        // SAFETY: valid context; these fields are writable in the sock_addr hooks weir uses.
        unsafe {
            if self.v6 {
                let words = v6_words(&endpoint.ip);
                let dst = core::ptr::addr_of_mut!((*self.ctx).user_ip6) as *mut u32;
                core::ptr::write_volatile(dst, words[0]);
                core::ptr::write_volatile(dst.add(1), words[1]);
                core::ptr::write_volatile(dst.add(2), words[2]);
                core::ptr::write_volatile(dst.add(3), words[3]);
            } else {
                let o = &endpoint.ip.octets;
                let word = u32::from_ne_bytes([o[12], o[13], o[14], o[15]]);
                core::ptr::write_volatile(core::ptr::addr_of_mut!((*self.ctx).user_ip4), word);
            }
            core::ptr::write_volatile(
                core::ptr::addr_of_mut!((*self.ctx).user_port),
                endpoint.port.to_be() as u32,
            );
        }
    }

    #[inline(always)]
    pub fn sock_type(&self) -> u32 {
        // SAFETY: valid context.
        unsafe { ctx_read!(self.ctx, type_) }
    }

    /// The socket the call is made on (always set in the sock_addr hooks).
    #[inline(always)]
    pub fn sk(&self) -> *mut bpf_sock {
        // SAFETY: valid context.
        unsafe { ctx_read!(self.ctx, __bindgen_anon_1.sk) }
    }

    /// The socket's `SO_MARK`.
    #[inline(always)]
    pub fn mark(&self) -> u32 {
        let sk = self.sk();
        if sk.is_null() {
            return 0;
        }
        // SAFETY: non-null socket pointer from the context.
        unsafe { ctx_read!(sk, mark) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> IpKey {
        IpKey::from_v4(a)
    }

    fn v6(s: &str) -> IpKey {
        IpKey::from_v6(s.parse::<core::net::Ipv6Addr>().unwrap().octets())
    }

    #[test]
    fn words_keep_network_order() {
        // A word as the kernel hands it (network order in memory) maps to the same octets.
        let word = u32::from_ne_bytes([10, 1, 2, 3]);
        assert_eq!(ip_from_v4_word(word), v4([10, 1, 2, 3]));
        let ip = v6("fd00::1:2");
        assert_eq!(ip_from_v6_words(v6_words(&ip)), ip);
        // An IPv4 address is the last word of its v4-mapped key.
        assert_eq!(v6_words(&v4([10, 1, 2, 3]))[3], word);
    }

    #[test]
    fn v4_mapped_is_recognised() {
        assert!(is_v4_mapped(&v4([192, 168, 0, 1])));
        assert!(!is_v4_mapped(&v6("::1")));
        assert!(
            !is_v4_mapped(&v6("::c0a8:1")),
            "v4-compatible is not v4-mapped"
        );
    }

    #[test]
    fn same_ip_compares_every_word() {
        assert!(same_ip(&v6("fd00::1"), &v6("fd00::1")));
        assert!(!same_ip(&v6("fd00::1"), &v6("fd01::1")));
        assert!(!same_ip(&v6("fd00::1"), &v6("fd00::2")));
        assert!(!same_ip(&v4([10, 0, 0, 1]), &v6("::a00:1")));
    }

    #[test]
    fn loopback_is_127_8_and_1() {
        assert!(is_loopback(&v4([127, 0, 0, 1])));
        assert!(is_loopback(&v4([127, 9, 9, 9])));
        assert!(is_loopback(&v6("::1")));
        assert!(!is_loopback(&v4([10, 0, 0, 1])));
        assert!(!is_loopback(&v6("::2")));
        assert!(!is_loopback(&v6("1::1")));
        assert_eq!(loopback_like(&v4([10, 0, 0, 1])), v4([127, 0, 0, 1]));
        assert_eq!(loopback_like(&v6("fd00::1")), v6("::1"));
    }

    #[test]
    fn sockaddrs_have_the_kernel_layout() {
        assert_eq!(size_of::<SockaddrIn>(), 16);
        assert_eq!(size_of::<SockaddrIn6>(), 28);
        let sin = SockaddrIn::new(&v4([10, 1, 2, 3]), 8080);
        assert_eq!(sin.port, 8080u16.to_be());
        assert_eq!(sin.addr, [10, 1, 2, 3]);
        let sin6 = SockaddrIn6::new(&v6("fd00::1"), 53);
        assert_eq!(sin6.family, AF_INET6 as u16);
        assert_eq!(sin6.addr, v6("fd00::1").octets);
    }
}
