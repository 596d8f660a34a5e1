//! A stand-in for a sidecar pod's istio-proxy (Envoy with istio's sidecar listeners), and what a
//! sidecar pod looks like to weir's policy. Like the ztunnel stand-in, it observes whatever the
//! datapath does to the pod's traffic as the real proxy would, without any policy of its own:
//! - it runs as the proxy's identity (uid and gid 1337): every socket it dials with is made by a
//!   thread of that identity, which is what exempts it from capture, as istio's `--uid-owner`;
//! - `virtualOutbound` on `[::]:15001` and `virtualInbound` on `[::]:15006` (dual-stack), each
//!   finding the destination with `SO_ORIGINAL_DST`, else the accepted socket's local address
//!   (Envoy's `original_dst` listener filter);
//! - 15001 dials the destination from the pod; 15006 dials the app from 127.0.0.6 (::6), the
//!   inbound passthrough source, as Envoy's `InboundPassthroughCluster` does.
//!
//! In TPROXY mode ([`Interception::Tproxy`]) it runs as istio's injector makes it then, uid 0
//! and gid 1337, with transparent listeners, and 15006 dials the app from the client's own
//! address (Envoy's `original_src`: transparent, freebind, `SO_MARK` 1337).
use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::thread;

use socket2::{Domain, Protocol, Socket, Type};
use weir_agent::policy::{
    local::{Container, ObjectMeta},
    SIDECAR_STATUS_ANNOTATION,
};
use weir_common::{INBOUND_PORT, OUTBOUND_PORT};

use crate::netns;
use crate::server::{Listener, Log, Server, Tracker};
use crate::sockopt::{self, canonical};
use crate::ztunnel::{Dial, Seen};
use crate::{io_timeout, Pod};

/// The proxy's uid and gid, istio's default.
pub const PROXY_ID: u32 = 1337;

/// A pod as istio's injector writes it with the CNI enabled: the status annotation,
/// `istio-validation` first among the init containers, and the `istio-proxy` container, with
/// `annotations` added (the injector's `traffic.sidecar.istio.io/*` among them) and `proxy_env`
/// on the proxy.
pub fn sidecar_pod(annotations: &[(&str, &str)], proxy_env: &[(&str, &str)]) -> ObjectMeta {
    let mut all: BTreeMap<String, String> = BTreeMap::from([
        (
            SIDECAR_STATUS_ANNOTATION.to_owned(),
            r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#.to_owned(),
        ),
        (
            "sidecar.istio.io/interceptionMode".to_owned(),
            "REDIRECT".to_owned(),
        ),
        (
            "traffic.sidecar.istio.io/includeInboundPorts".to_owned(),
            "*".to_owned(),
        ),
        (
            "traffic.sidecar.istio.io/excludeInboundPorts".to_owned(),
            "15020".to_owned(),
        ),
        (
            "traffic.sidecar.istio.io/includeOutboundIPRanges".to_owned(),
            "*".to_owned(),
        ),
    ]);
    for (key, value) in annotations {
        all.insert((*key).to_owned(), (*value).to_owned());
    }
    let proxy_id = Some(i64::from(PROXY_ID));
    ObjectMeta {
        annotations: all,
        containers: vec![
            Container {
                name: "istio-validation".into(),
                args: vec!["istio-iptables".into(), "--run-validation".into()],
                run_as_user: proxy_id,
                run_as_group: proxy_id,
                ..Container::default()
            },
            Container {
                name: "app".into(),
                ..Container::default()
            },
            Container {
                name: "istio-proxy".into(),
                args: vec!["proxy".into(), "sidecar".into()],
                env: proxy_env
                    .iter()
                    .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                    .collect(),
                run_as_user: proxy_id,
                run_as_group: proxy_id,
            },
        ],
        ..ObjectMeta::default()
    }
}

/// How inbound traffic reaches the proxy (`sidecar.istio.io/interceptionMode`), which shapes
/// the proxy too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interception {
    Redirect,
    Tproxy,
}

impl Interception {
    /// Runs `f` on a new thread of the caller's network namespace with the proxy's identity, for
    /// that thread alone (the raw syscalls; libc's wrappers change every thread): uid and gid
    /// 1337, or in TPROXY mode gid 1337 with uid 0 (which keeps its capabilities).
    pub fn as_proxy<T: Send>(self, f: impl FnOnce() -> T + Send) -> T {
        thread::scope(|scope| {
            scope
                .spawn(|| {
                    // SAFETY: plain syscalls on this thread's credentials; the gid goes first,
                    // while the thread may still change it.
                    unsafe {
                        let id = PROXY_ID as libc::c_long;
                        assert_eq!(libc::syscall(libc::SYS_setresgid, id, id, id), 0);
                        if self == Interception::Redirect {
                            assert_eq!(libc::syscall(libc::SYS_setresuid, id, id, id), 0);
                        }
                    }
                    f()
                })
                .join()
                .expect("the proxy thread")
        })
    }
}

/// [`Interception::as_proxy`] for the usual proxy, REDIRECT mode's.
pub fn as_proxy<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    Interception::Redirect.as_proxy(f)
}

/// The proxy's listeners in one pod; stopped on drop.
pub struct SidecarStandIn {
    seen: Arc<Log<Seen>>,
    dials: Arc<Log<Dial>>,
    _server: Server,
}

impl SidecarStandIn {
    pub fn start(pod: &Pod) -> io::Result<Self> {
        Self::start_with(pod, Interception::Redirect)
    }

    pub fn start_with(pod: &Pod, interception: Interception) -> io::Result<Self> {
        let netns: OwnedFd = pod.netns().open()?.into();
        let seen = Arc::new(Log::default());
        let dials = Arc::new(Log::default());
        let listeners = netns::run_in(netns.as_fd(), || {
            [OUTBOUND_PORT, INBOUND_PORT]
                .map(|port| listener(port, interception).map(|listener| (port, listener)))
                .into_iter()
                .collect::<io::Result<Vec<_>>>()
        })?
        .into_iter()
        .map(|(port, listener)| {
            let (seen, dials) = (seen.clone(), dials.clone());
            let handler = move |stream: TcpStream, tracker: &Tracker| {
                if let Err(err) = serve(port, interception, stream, &seen, &dials, tracker) {
                    eprintln!("sidecar stand-in :{port}: {err}");
                }
            };
            Listener::Tcp(listener, Arc::new(handler))
        })
        .collect();
        let server = Server::start(netns.as_fd(), "istio-proxy", listeners)?;
        Ok(Self {
            seen,
            dials,
            _server: server,
        })
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.entries()
    }

    pub fn wait_for(
        &self,
        predicate: impl Fn(&Seen) -> bool,
        timeout: std::time::Duration,
    ) -> Option<Seen> {
        self.seen.wait_for(predicate, timeout)
    }

    pub fn dials(&self) -> Vec<Dial> {
        self.dials.entries()
    }
}

fn listener(port: u16, interception: Interception) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_only_v6(false)?;
    socket.set_reuse_address(true)?;
    if interception == Interception::Tproxy {
        sockopt::set_transparent(&socket)?;
    }
    socket.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
    socket.listen(128)?;
    Ok(socket.into())
}

fn serve(
    port: u16,
    interception: Interception,
    client: TcpStream,
    seen: &Log<Seen>,
    dials: &Log<Dial>,
    tracker: &Tracker,
) -> io::Result<()> {
    let entry = Seen {
        listener: port,
        peer: canonical(client.peer_addr()?),
        local: canonical(client.local_addr()?),
        original_dst: sockopt::original_dst(&client),
    };
    seen.push(entry.clone());
    let target = entry.destination();
    let source = match (port, interception) {
        (INBOUND_PORT, Interception::Redirect) => Some(Source::Passthrough(match target.ip() {
            IpAddr::V4(_) => IpAddr::from(Ipv4Addr::new(127, 0, 0, 6)),
            IpAddr::V6(_) => IpAddr::from(Ipv6Addr::from(6u128)),
        })),
        (INBOUND_PORT, Interception::Tproxy) => Some(Source::Client(entry.peer.ip())),
        _ => None,
    };
    let dialed = interception.as_proxy(|| dial(source, target));
    dials.push(Dial {
        listener: port,
        peer: entry.peer,
        target,
        source: dialed
            .as_ref()
            .ok()
            .and_then(|upstream| upstream.local_addr().ok())
            .map(canonical),
        error: dialed.as_ref().err().map(ToString::to_string),
    });
    let upstream = match dialed {
        Ok(upstream) => upstream,
        Err(_) => return Ok(()),
    };
    let _tracked = tracker.track(&upstream)?;
    thread::scope(|scope| {
        scope.spawn(|| pipe(&client, &upstream));
        pipe(&upstream, &client);
    });
    Ok(())
}

/// Where the proxy's dial to the app comes from.
#[derive(Clone, Copy)]
enum Source {
    /// 127.0.0.6 or ::6.
    Passthrough(IpAddr),
    /// The client's own address, as Envoy's `original_src` makes it: transparent, freebind,
    /// marked 1337.
    Client(IpAddr),
}

fn dial(source: Option<Source>, target: SocketAddr) -> io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(target),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    let source = match source {
        None => None,
        Some(Source::Passthrough(ip)) => Some(ip),
        Some(Source::Client(ip)) => {
            socket.set_mark(PROXY_ID)?;
            sockopt::set_transparent(&socket)?;
            sockopt::set_freebind(&socket)?;
            Some(ip)
        }
    };
    if let Some(source) = source {
        socket.bind(&SocketAddr::new(source, 0).into())?;
    }
    socket.connect_timeout(&target.into(), io_timeout())?;
    Ok(socket.into())
}

fn pipe(from: &TcpStream, to: &TcpStream) {
    let _ = io::copy(&mut &*from, &mut &*to);
    let _ = to.shutdown(Shutdown::Write);
}
