//! Addresses as the kernel hands them to programs, converted to and from the ABI's `Endpoint`.
use aya_ebpf::bindings::{bpf_sock, bpf_sock_addr};
use weir_common::{Endpoint, IpKey};

pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;
pub const SOCK_STREAM: u32 = 1;
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
