//! A stand-in for istio's `istio-validation` init container (`pilot-agent istio-iptables
//! --run-validation --skip-rule-apply`), which a sidecar pod runs first when istio's injector
//! knows the CNI redirects the pod. It checks that redirection is in place exactly as istio's
//! validator does, and exits as it does: 0 when it is, 126 when it is not.
//!
//! It listens on 127.0.0.1:15001 and 127.0.0.1:15006 (port reuse on), and every second connects
//! from 127.0.0.1 to 127.0.0.6:15002, where nothing listens; in a pod whose first address
//! (`INSTANCE_IP`, the pod's `status.podIP`) is IPv6, on `[::1]` and from `[::1]` to
//! `[::6]:15002`, as istio's validator does there. An accepted connection is answered
//! with its `SO_ORIGINAL_DST` port; the original port 15002 proves redirection. Run it as the
//! proxy's uid (1337): it is the proxy's own traffic to its pod that is redirected (the hairpin).
//! `PROBE_TIMEOUT` (seconds, default 5) bounds the whole check, as istio's.
use std::{
    io::Write,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use socket2::{Domain, Protocol, Socket, Type};

const PROBE_PORT: u16 = 15002;
const LISTEN_PORTS: [u16; 2] = [15001, 15006];
const VALIDATION_ERROR_CODE: i32 = 126;

/// Where the validator listens, and the address it probes.
struct Addresses {
    listen: IpAddr,
    probe: IpAddr,
}

impl Addresses {
    fn of_this_pod() -> Self {
        let first_is_ipv6 = std::env::var("INSTANCE_IP")
            .ok()
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .is_some_and(|ip| ip.is_ipv6());
        if first_is_ipv6 {
            Self {
                listen: Ipv6Addr::LOCALHOST.into(),
                probe: Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6).into(),
            }
        } else {
            Self {
                listen: Ipv4Addr::LOCALHOST.into(),
                probe: Ipv4Addr::new(127, 0, 0, 6).into(),
            }
        }
    }
}

fn main() {
    let timeout = std::env::var("PROBE_TIMEOUT")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(5), Duration::from_secs);
    let deadline = Instant::now() + timeout;
    let addresses = Addresses::of_this_pod();
    let (passed, outcome) = mpsc::channel();
    let mut listening = 0;
    for port in LISTEN_PORTS {
        match listen(SocketAddr::new(addresses.listen, port)) {
            Ok(listener) => {
                listening += 1;
                let passed = passed.clone();
                thread::spawn(move || serve(listener, passed));
            }
            Err(err) => eprintln!(
                "listening on {}: {err}",
                SocketAddr::new(addresses.listen, port)
            ),
        }
    }
    if listening == 0 {
        fail("no listener available");
    }
    thread::spawn(move || probe(&addresses));
    match outcome.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(()) => {
            println!("Validation passed, iptables rules established");
            std::process::exit(0);
        }
        Err(_) => fail("timed out"),
    }
}

fn fail(why: &str) -> ! {
    eprintln!(
        "iptables validation failed; workload is not ready for Istio ({why}).\n\
         When using Istio CNI, this can occur if a pod is scheduled before the node is ready."
    );
    std::process::exit(VALIDATION_ERROR_CODE)
}

fn listen(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.bind(&address.into())?;
    socket.listen(16)?;
    Ok(socket.into())
}

fn serve(listener: TcpListener, passed: mpsc::Sender<()>) {
    for mut stream in listener.incoming().flatten() {
        let port = weir_tests::sockopt::original_dst(&stream).map(|dst| dst.port());
        let _ = write!(stream, "{}", port.unwrap_or(0));
        if port == Some(PROBE_PORT) {
            let _ = passed.send(());
        }
    }
}

fn probe(addresses: &Addresses) {
    let target = SocketAddr::new(addresses.probe, PROBE_PORT);
    let source = SocketAddr::new(addresses.listen, 0);
    loop {
        if let Err(err) = connect(source, target) {
            eprintln!("validation probe to {target}: {err}");
        }
        thread::sleep(Duration::from_secs(1));
    }
}

fn connect(source: SocketAddr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(target),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.bind(&source.into())?;
    socket.connect_timeout(&target.into(), Duration::from_secs(1))?;
    Ok(socket.into())
}
