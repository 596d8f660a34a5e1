//! Original destination: ztunnel asks `getsockopt(SO_ORIGINAL_DST)` on the socket it accepted on
//! 15001. That socket is not the app's, so the record made at connect time (by socket cookie) is
//! moved, once the connection has its source port, under the tuple ztunnel's side sees.
use aya_ebpf::{
    bindings::{bpf_sock, bpf_sockopt, BPF_SOCK_OPS_TCP_CONNECT_CB},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use weir_common::{ConnectionKey, Endpoint, TraceHook, TraceVerdict, DNS_PROXY_PORT};

use crate::{
    diag::{diag, ip},
    maps::{original_destination, pod_with_ip, CONN_ORIG_DST, SOCKET_ORIG_DST},
    net::{ctx_read, is_v4_mapped, socket_addresses, SockaddrIn, SockaddrIn6, ALLOW, IPPROTO_TCP},
    trace::{trace, TCP},
};

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `SO_ORIGINAL_DST` and `IP6T_SO_ORIGINAL_DST` share the number.
const SO_ORIGINAL_DST: i32 = 80;

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
    // SAFETY: valid context.
    let key = unsafe {
        let Some((client_ip, listener_ip)) =
            socket_addresses!(ops, (local_ip4, remote_ip4), (local_ip6, remote_ip6))
        else {
            return;
        };
        // local_port is in host order; remote_port holds the network-order port in its upper
        // half.
        ConnectionKey {
            client: Endpoint::new(client_ip, ctx_read!(ops, local_port) as u16),
            listener: Endpoint::new(
                listener_ip,
                u16::from_be((ctx_read!(ops, remote_port) >> 16) as u16),
            ),
        }
    };
    // ztunnel's DNS proxy never asks: it answers from the query. An entry for a connection to it
    // would only sit in the map, under a loopback tuple another pod's can equal, and push out
    // the entries ztunnel does ask for.
    if key.listener.port == DNS_PROXY_PORT {
        return;
    }
    let _ = CONN_ORIG_DST.insert(key, original, 0);
}

/// The kernel hands a program at most a page of the caller's buffer.
const PAGE_SIZE: i32 = 4096;

/// Runs for every getsockopt in the cgroup (the whole node): leave everything but
/// SO_ORIGINAL_DST on a connection weir redirected exactly as the kernel answered it.
#[cgroup_sockopt(getsockopt)]
pub fn weir_getsockopt(ctx: SockoptContext) -> i32 {
    let opt = ctx.sockopt;
    // SAFETY: the context pointer is valid for the program's run.
    unsafe {
        if !answer_original_dst(opt) {
            keep_kernel_answer(opt);
        }
    }
    ALLOW
}

/// An answer longer than the page the program was shown must be handed back with `optlen = 0`
/// ("use the kernel's buffer as it is"): from 5.8 until 6.5 the kernel fails the call with
/// EFAULT otherwise, for every process on the node (iptables-legacy's table dump is one).
#[inline(always)]
unsafe fn keep_kernel_answer(opt: *mut bpf_sockopt) {
    if ctx_read!(opt, optlen) > PAGE_SIZE {
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*opt).optlen), 0);
    }
}

/// Answers SO_ORIGINAL_DST for a connection weir redirected; returns whether it did.
#[inline(always)]
unsafe fn answer_original_dst(opt: *mut bpf_sockopt) -> bool {
    let level = ctx_read!(opt, level);
    if ctx_read!(opt, optname) != SO_ORIGINAL_DST || (level != SOL_IP && level != SOL_IPV6) {
        return false;
    }
    let sk: *mut bpf_sock = ctx_read!(opt, __bindgen_anon_1.sk);
    if sk.is_null() || ctx_read!(sk, protocol) != IPPROTO_TCP {
        return false;
    }
    let Some((local_ip, remote_ip)) = socket_addresses!(sk, (src_ip4, dst_ip4), (src_ip6, dst_ip6))
    else {
        return false;
    };
    let key = ConnectionKey {
        client: Endpoint::new(remote_ip, u16::from_be(ctx_read!(sk, dst_port))),
        listener: Endpoint::new(local_ip, ctx_read!(sk, src_port) as u16),
    };
    let Some(original) = original_destination(&key) else {
        return false;
    };
    // Answer in the family the caller asked in, as netfilter does: SOL_IP for an IPv4 original
    // destination (also on ztunnel's IPv4-mapped AF_INET6 sockets), SOL_IPV6 for an IPv6 one.
    let v4 = is_v4_mapped(&original.ip);
    let answered = if level == SOL_IP && v4 {
        write_answer(opt, &SockaddrIn::new(&original.ip, original.port))
    } else if level == SOL_IPV6 && !v4 {
        write_answer(opt, &SockaddrIn6::new(&original.ip, original.port))
    } else {
        false
    };
    if answered {
        // Asked once per accepted connection: the entry has served its purpose.
        let _ = CONN_ORIG_DST.remove(key);
        // ztunnel asks on its socket in the pod: the listener's address is the pod's.
        trace!(
            TraceHook::Getsockopt,
            TraceVerdict::OriginalDst,
            pod_with_ip(&key.listener.ip).unwrap_or(0),
            TCP,
            (&key.client.ip, key.client.port),
            (&original.ip, original.port),
            (&key.listener.ip, key.listener.port)
        );
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
    answered
}

/// Writes a sockaddr as the call's result, if the caller's buffer holds it; returns whether it
/// did. Its size is a constant per call site so the verifier can check the bound.
#[inline(always)]
unsafe fn write_answer<T: Copy>(opt: *mut bpf_sockopt, answer: &T) -> bool {
    let len = size_of::<T>();
    if (ctx_read!(opt, optlen) as usize) < len {
        return false;
    }
    let optval = ctx_read!(opt, __bindgen_anon_2.optval) as *mut u8;
    let optval_end = ctx_read!(opt, __bindgen_anon_3.optval_end) as *mut u8;
    if optval.add(len) > optval_end {
        return false;
    }
    let bytes = answer as *const T as *const u8;
    let mut i = 0;
    while i < len {
        core::ptr::write_volatile(optval.add(i), *bytes.add(i));
        i += 1;
    }
    core::ptr::write_volatile(core::ptr::addr_of_mut!((*opt).optlen), len as i32);
    core::ptr::write_volatile(core::ptr::addr_of_mut!((*opt).retval), 0);
    true
}
