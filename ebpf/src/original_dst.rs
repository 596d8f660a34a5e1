//! Original destination: ztunnel asks `getsockopt(SO_ORIGINAL_DST)` on the socket it accepted on
//! 15001. That socket is not the app's, so the record made at connect time (by socket cookie) is
//! moved, once the connection has its source port, under the tuple ztunnel's side sees.
use aya_ebpf::{
    bindings::{bpf_sock, bpf_sockopt, BPF_SOCK_OPS_TCP_CONNECT_CB},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use weir_common::{ConnectionKey, Endpoint};

use crate::{
    diag::{diag, ip},
    maps::{CONN_ORIG_DST, SOCKET_ORIG_DST},
    net::{
        ctx_read, ip_from_v4_word, ip_from_v6_words, is_v4_mapped, AF_INET, AF_INET6, ALLOW,
        IPPROTO_TCP,
    },
};

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: i32 = 80;
const SOCKADDR_IN_LEN: usize = 16;
const SOCKADDR_IN6_LEN: usize = 28;

#[sock_ops]
pub fn weir_sockops(ctx: SockOpsContext) -> u32 {
    if ctx.op() == BPF_SOCK_OPS_TCP_CONNECT_CB {
        remember_connection(&ctx);
    }
    0
}

#[inline(always)]
fn remember_connection(ctx: &SockOpsContext) {
    let ops = ctx.ops;
    // SAFETY: valid context; `sk` may be null and is checked.
    let sk = unsafe { ctx_read!(ops, __bindgen_anon_2.sk) };
    if sk.is_null() {
        return;
    }
    let Some(original) = SOCKET_ORIG_DST.of(sk) else {
        return;
    };
    // SAFETY: valid context. Every field is loaded unconditionally and the family picks among
    // the values afterwards: loads inside family branches let LLVM merge the field addresses,
    // and the verifier rejects a dereference of a computed context pointer.
    let key = unsafe {
        let family = ctx_read!(ops, family);
        let v4 = (ctx_read!(ops, local_ip4), ctx_read!(ops, remote_ip4));
        let local_ip6 = [
            ctx_read!(ops, local_ip6[0]),
            ctx_read!(ops, local_ip6[1]),
            ctx_read!(ops, local_ip6[2]),
            ctx_read!(ops, local_ip6[3]),
        ];
        let remote_ip6 = [
            ctx_read!(ops, remote_ip6[0]),
            ctx_read!(ops, remote_ip6[1]),
            ctx_read!(ops, remote_ip6[2]),
            ctx_read!(ops, remote_ip6[3]),
        ];
        // local_port is in host order; remote_port holds the network-order port in its upper
        // half.
        let local_port = ctx_read!(ops, local_port) as u16;
        let remote_port = u16::from_be((ctx_read!(ops, remote_port) >> 16) as u16);
        let (client_ip, listener_ip) = match family {
            AF_INET => (ip_from_v4_word(v4.0), ip_from_v4_word(v4.1)),
            AF_INET6 => (ip_from_v6_words(local_ip6), ip_from_v6_words(remote_ip6)),
            _ => return,
        };
        ConnectionKey {
            client: Endpoint::new(client_ip, local_port),
            listener: Endpoint::new(listener_ip, remote_port),
        }
    };
    let _ = CONN_ORIG_DST.insert(&key, &original);
}

/// Runs for every getsockopt in the cgroup (the whole node): leave everything but
/// SO_ORIGINAL_DST on a connection weir redirected exactly as the kernel answered it.
#[cgroup_sockopt(getsockopt)]
pub fn weir_getsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    unsafe { answer_original_dst(ctx) };
    ALLOW
}

#[inline(always)]
unsafe fn answer_original_dst(ctx: SockoptContext) {
    let opt = ctx.sockopt;
    let level = ctx_read!(opt, level);
    if ctx_read!(opt, optname) != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6) {
        return;
    }
    let sk: *mut bpf_sock = ctx_read!(opt, __bindgen_anon_1.sk);
    if sk.is_null() || ctx_read!(sk, protocol) != IPPROTO_TCP {
        return;
    }
    // Loaded unconditionally, then picked by family: see `remember_connection`.
    let family = ctx_read!(sk, family);
    let v4 = (ctx_read!(sk, src_ip4), ctx_read!(sk, dst_ip4));
    let src_ip6 = [
        ctx_read!(sk, src_ip6[0]),
        ctx_read!(sk, src_ip6[1]),
        ctx_read!(sk, src_ip6[2]),
        ctx_read!(sk, src_ip6[3]),
    ];
    let dst_ip6 = [
        ctx_read!(sk, dst_ip6[0]),
        ctx_read!(sk, dst_ip6[1]),
        ctx_read!(sk, dst_ip6[2]),
        ctx_read!(sk, dst_ip6[3]),
    ];
    let src_port = ctx_read!(sk, src_port) as u16;
    let dst_port = u16::from_be(ctx_read!(sk, dst_port));
    let (local_ip, remote_ip) = match family {
        AF_INET => (ip_from_v4_word(v4.0), ip_from_v4_word(v4.1)),
        AF_INET6 => (ip_from_v6_words(src_ip6), ip_from_v6_words(dst_ip6)),
        _ => return,
    };
    let key = ConnectionKey {
        client: Endpoint::new(remote_ip, dst_port),
        listener: Endpoint::new(local_ip, src_port),
    };
    let Some(original) = CONN_ORIG_DST.get(&key) else {
        return;
    };
    let original = *original;
    // Answer in the family the caller asked in, as netfilter does: SOL_IP for an IPv4 original
    // destination (also on ztunnel's IPv4-mapped AF_INET6 sockets), SOL_IPV6 for an IPv6 one.
    let v4 = is_v4_mapped(&original.ip);
    let port = original.port.to_be_bytes();
    let answered = if level == SOL_IP && v4 {
        let mut sin = [0u8; SOCKADDR_IN_LEN];
        sin[..2].copy_from_slice(&(AF_INET as u16).to_ne_bytes());
        sin[2..4].copy_from_slice(&port);
        sin[4..8].copy_from_slice(&original.ip.octets[12..16]);
        write_answer(opt, &sin)
    } else if level == SOL_IPV6 && !v4 {
        let mut sin6 = [0u8; SOCKADDR_IN6_LEN];
        sin6[..2].copy_from_slice(&(AF_INET6 as u16).to_ne_bytes());
        sin6[2..4].copy_from_slice(&port);
        sin6[8..24].copy_from_slice(&original.ip.octets);
        write_answer(opt, &sin6)
    } else {
        false
    };
    if answered {
        // Asked once per accepted connection: the entry has served its purpose.
        let _ = CONN_ORIG_DST.remove(&key);
        diag!(
            debug,
            opt,
            "SO_ORIGINAL_DST for {:i}:{}: {:i}:{}",
            ip(&key.client.ip),
            key.client.port,
            ip(&original.ip),
            original.port
        );
    }
}

/// Writes a sockaddr as the call's result, if the caller's buffer holds it; returns whether it
/// did. The length is a constant per call site so the verifier can check the bound.
#[inline(always)]
unsafe fn write_answer<const N: usize>(opt: *mut bpf_sockopt, answer: &[u8; N]) -> bool {
    if (ctx_read!(opt, optlen) as usize) < N {
        return false;
    }
    let optval = ctx_read!(opt, __bindgen_anon_2.optval) as *mut u8;
    let optval_end = ctx_read!(opt, __bindgen_anon_3.optval_end) as *mut u8;
    if optval.add(N) > optval_end {
        return false;
    }
    let mut i = 0;
    while i < N {
        core::ptr::write_volatile(optval.add(i), answer[i]);
        i += 1;
    }
    core::ptr::write_volatile(core::ptr::addr_of_mut!((*opt).optlen), N as i32);
    core::ptr::write_volatile(core::ptr::addr_of_mut!((*opt).retval), 0);
    true
}
