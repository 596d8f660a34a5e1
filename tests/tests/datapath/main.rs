//! The datapath in this kernel: real programs, pods wired by the real CNI plugins, bytes flowing
//! through the ztunnel stand-in. Each test has its own node netns and pin directory, so tests run
//! in parallel; the datapath is uninstalled when a test ends, also when it fails.
use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use weir_agent::{
    datapath::{
        istio_rules::IstioRules, netlink::Rtnl, Datapath, DatapathConfig, EnrollNetns, ProbeSource,
    },
    workload::{PodOptions, Workload},
};
use weir_common::{
    maps, ConnectionKey, Endpoint, PodCounters, DNS_PORT, DNS_PROXY_PORT, HANDOFF_SLOTS,
    HBONE_PORT, INBOUND_PORT, OUTBOUND_PORT, PROBE_SOURCE_V4, PROBE_SOURCE_V6,
};
use weir_tests::{cgroup, privileged};
use weir_tests::{
    istio_iptables,
    netns::{ip, ip_output},
    raw::{self, Answer},
    receive_batch::kernel_needs_the_handoff,
    sockopt, tcp_attempt, tcp_request, tcp_request_within,
    traffic::exchange_line,
    traffic_loop::{wait_for_connections, Connection, TrafficLoop},
    udp_request, udp_request_connected,
    ztunnel::{DNS_REPLY_PREFIX, HBONE_REPLY},
    DatapathNode, EchoServer, Pod, TestNode, ZtunnelStandIn, APP_PORT,
};
use weir_tests::{try_wait_until, wait_until};

mod audit;
mod inbound;
mod lifecycle;
mod original_dst;
mod outbound;
mod probes;

const WAIT: Duration = Duration::from_secs(2);
/// A port nothing in the test pods listens on.
const CLOSED_PORT: u16 = 8081;

fn v4_mapped(ip: Ipv4Addr) -> IpAddr {
    IpAddr::V6(ip.to_ipv6_mapped())
}

/// An enrolled pod `app` with its ztunnel, and a pod `server` (not enrolled) running the echo app.
fn enrolled_app_and_server(
    fixture: &DatapathNode,
) -> (Pod, Pod, EchoServer, ZtunnelStandIn, Datapath) {
    let (pod, server) = (fixture.pod("app"), fixture.pod("server"));
    let echo = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start(&pod).unwrap();
    let datapath = fixture.enrolled(&pod, PodOptions::default());
    (pod, server, echo, ztunnel, datapath)
}

fn counters(datapath: &Datapath, pod: &Pod) -> PodCounters {
    datapath
        .counters(pod.uid())
        .wait()
        .unwrap()
        .expect("pod is enrolled")
}

/// A TCP request from a socket marked like ztunnel's.
fn marked_tcp_request(target: SocketAddr, msg: &str) -> std::io::Result<String> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(target),
        socket2::Type::STREAM,
        None,
    )?;
    socket.set_mark(weir_common::ZTUNNEL_MARK)?;
    socket.connect_timeout(&target.into(), WAIT)?;
    let mut stream = std::net::TcpStream::from(socket);
    stream.set_read_timeout(Some(WAIT))?;
    writeln!(stream, "{msg}")?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    Ok(line.trim_end().to_owned())
}
