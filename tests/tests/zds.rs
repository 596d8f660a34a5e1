//! The agent's ZDS server against the ZDS ztunnel stand-in: hello and snapshots, Add with the
//! pod's netns fd, Del, several connections, failures, misbehaving clients, the metrics.
//!
//! Each test has its own socket (in a temporary directory), its own network namespaces and its
//! own server on a runtime of its own, so they run in parallel. Tests that hand over a netns
//! (every Add) need root; the others do not.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tempfile::TempDir;
use weir_agent::zds::{WorkloadInfo, ZdsError, ZdsHandle};
use weir_common::HBONE_PORT;
use weir_tests::zds_server::ZdsServer;
use weir_tests::ztunnel::HBONE_REPLY;
use weir_tests::{
    netns, privileged, tcp_request, wait_until, Metrics, NetNs, NetnsId, ZdsEvent, ZdsReply,
    ZdsZtunnel,
};

/// Long enough for anything but a deliberate timeout (the server's deadlines are 5 s).
const WAIT: Duration = Duration::from_secs(10);

/// A ZDS server on a runtime of its own: the test thread stays free to block on the client.
struct Server {
    server: ZdsServer,
    handle: ZdsHandle,
    socket: PathBuf,
    _dir: TempDir,
}

impl Server {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        // A directory the server must create, holding a stale file it must replace.
        let socket = dir.path().join("ztunnel").join("ztunnel.sock");
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        std::fs::write(&socket, "stale").unwrap();
        let server = ZdsServer::start(&socket);
        Self {
            handle: server.handle.clone(),
            server,
            socket,
            _dir: dir,
        }
    }

    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.server.block_on(future)
    }

    fn connect(&self) -> ZdsZtunnel {
        let client = ZdsZtunnel::connect(&self.socket).unwrap();
        assert!(
            client.wait_for_snapshot(WAIT),
            "no snapshot: {:?}",
            client.events()
        );
        client
    }

    fn add(&self, uid: &str, netns: Option<&NetNs>) -> Result<(), ZdsError> {
        let netns = netns.map(|netns| Arc::new(OwnedFd::from(netns.open().unwrap())));
        self.block_on(self.handle.add(uid, info(uid), netns))
    }

    fn del(&self, uid: &str) -> Result<(), ZdsError> {
        self.block_on(self.handle.del(uid))
    }

    /// Waits until exactly `count` ztunnels are connected; false on timeout.
    fn wait_connections(&self, count: usize) -> bool {
        let mut connections = self.handle.connections();
        self.block_on(async {
            tokio::time::timeout(WAIT, connections.wait_for(|now| *now == count))
                .await
                .is_ok()
        })
    }

    /// The server's metrics, as the agent would serve them.
    fn metrics(&self) -> Metrics {
        Metrics::of_registry(&self.server.registry)
    }

    /// The snapshots ztunnels acknowledged.
    fn snapshot_acks(&self) -> Option<f64> {
        self.metrics()
            .value("weir_zds_acks_total", &[("message", "snapshot_sent")])
    }
}

fn info(uid: &str) -> WorkloadInfo {
    WorkloadInfo {
        name: format!("pod-{uid}"),
        namespace: "default".into(),
        service_account: "app".into(),
    }
}

/// A pod's network namespace with `lo` up (the stand-in binds 127.0.0.1) and `ip` on `eth0`
/// (one end of a veth pair kept inside), to be found from inside.
fn pod_netns(role: &str, ip: Ipv4Addr) -> anyhow::Result<NetNs> {
    let netns = NetNs::create(role)?;
    let (name, address) = (netns.name(), format!("{ip}/32"));
    for args in [
        ["-n", name, "link", "set", "lo", "up"].as_slice(),
        &[
            "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
        ],
        &["-n", name, "addr", "add", &address, "dev", "eth0"],
        &["-n", name, "link", "set", "eth0", "up"],
        &["-n", name, "link", "set", "peer0", "up"],
    ] {
        netns::ip(args)?;
    }
    Ok(netns)
}

fn adds(client: &ZdsZtunnel) -> Vec<String> {
    let events = client.events();
    let adds = events.iter().filter(|e| matches!(e, ZdsEvent::Add { .. }));
    adds.filter_map(|e| e.uid().map(str::to_owned)).collect()
}

fn count(client: &ZdsZtunnel, wanted: impl Fn(&ZdsEvent) -> bool) -> usize {
    client.events().iter().filter(|e| wanted(e)).count()
}

#[test]
fn hello_then_empty_snapshot_and_the_gauge() {
    let server = Server::start();
    assert_eq!(server.metrics().value("ztunnel_connected", &[]), Some(0.0));
    let client = server.connect();
    assert!(server.wait_connections(1));
    assert_eq!(server.metrics().value("ztunnel_connected", &[]), Some(1.0));
    assert_eq!(client.events(), [ZdsEvent::SnapshotSent]);
    wait_until(WAIT, "the first snapshot's ack", || {
        server.snapshot_acks() == Some(1.0)
    });

    let second = server.connect();
    assert!(server.wait_connections(2));
    assert_eq!(server.metrics().value("ztunnel_connected", &[]), Some(2.0));
    client.disconnect();
    assert!(server.wait_connections(1));
    second.disconnect();
    assert!(server.wait_connections(0));
    assert_eq!(server.metrics().value("ztunnel_connected", &[]), Some(0.0));
}

#[test]
fn unknown_hello_version_is_accepted_as_istio_does() {
    let server = Server::start();
    // ZdsHello { version: 7 }
    let client = ZdsZtunnel::connect_with_hello(&server.socket, Some(&[0x08, 7])).unwrap();
    assert!(client.wait_for_snapshot(WAIT), "{:?}", client.events());
}

#[test]
fn add_hands_over_the_pods_netns() {
    let ip = Ipv4Addr::new(10, 251, 0, 7);
    let netns = privileged!(pod_netns("zdsadd", ip));
    let server = Server::start();
    let client = server.connect();

    server.add("uid-a", Some(&netns)).unwrap();

    let event = client
        .events()
        .into_iter()
        .find(|e| e.uid() == Some("uid-a"));
    let Some(ZdsEvent::Add {
        info: Some(got),
        netns: Some(received),
        pod_ips,
        ..
    }) = event
    else {
        panic!("no Add with info and fd: {:?}", client.events());
    };
    assert_eq!(got, info("uid-a"));
    // The fd the stand-in received is the pod's namespace itself.
    assert_eq!(received, NetnsId::of(&netns).unwrap());
    assert_eq!(pod_ips, [IpAddr::from(ip)]);
    // And a stand-in is serving in it.
    assert!(client.stand_in("uid-a").is_some());
    let reply = netns
        .run(|| tcp_request((ip, HBONE_PORT).into(), "CONNECT"))
        .unwrap();
    assert_eq!(reply.response, HBONE_REPLY);
    assert_eq!(
        server
            .metrics()
            .value("weir_zds_requests_total", &[("message", "add")]),
        Some(1.0)
    );
    assert_eq!(
        server
            .metrics()
            .value("weir_zds_acks_total", &[("message", "add")]),
        Some(1.0)
    );

    server.del("uid-a").unwrap();
    assert_eq!(
        client.events().last(),
        Some(&ZdsEvent::Del {
            uid: "uid-a".into()
        })
    );
    assert!(client.stand_in("uid-a").is_none());
}

#[test]
fn every_connect_gets_a_snapshot() {
    let (ns_a, ns_c) = privileged!(Ok((
        pod_netns("zdssnapa", Ipv4Addr::new(10, 251, 1, 1))?,
        pod_netns("zdssnapc", Ipv4Addr::new(10, 251, 1, 3))?,
    )));
    let server = Server::start();
    let mut acked = server.handle.acked();
    assert!(matches!(
        server.add("a", Some(&ns_a)),
        Err(ZdsError::NotConnected)
    ));
    // Without a netns: only registered, and named with Keep.
    server.add("b", None).unwrap();
    assert!(matches!(
        server.add("c", Some(&ns_c)),
        Err(ZdsError::NotConnected)
    ));

    for round in 0..2 {
        let client = server.connect();
        let events = client.events();
        assert_eq!(events.len(), 4, "round {round}: {events:?}");
        assert_eq!(events.last(), Some(&ZdsEvent::SnapshotSent));
        let mut added = adds(&client);
        added.sort();
        assert_eq!(added, ["a", "c"], "round {round}");
        assert!(events.contains(&ZdsEvent::Keep { uid: "b".into() }));
        for event in &events {
            if let ZdsEvent::Add { uid, netns, .. } = event {
                let expected = if uid == "a" { &ns_a } else { &ns_c };
                assert_eq!(*netns, Some(NetnsId::of(expected).unwrap()), "{uid}");
            }
        }
        // The snapshot's Adds are reported acked (the Keep is not).
        let mut reported = server.block_on(async {
            let mut uids = Vec::new();
            for _ in 0..2 {
                uids.push(
                    tokio::time::timeout(WAIT, acked.recv())
                        .await
                        .unwrap()
                        .unwrap(),
                );
            }
            uids
        });
        reported.sort();
        assert_eq!(reported, ["a", "c"], "round {round}");
        client.disconnect();
        assert!(server.wait_connections(0));
    }
    assert!(acked.try_recv().is_err());
}

/// istio-cni's node agent removes the socket path when it leaves the node, the path weir listens
/// on too once it takes the node over; and another agent starting meanwhile puts a socket of its
/// own there. Either way ztunnel, which connects by path, must find weir when it reconnects,
/// while a connection already made goes on.
#[test]
fn ztunnel_finds_the_agent_after_its_socket_file_is_removed_or_replaced() {
    let server = Server::start();
    let kept = server.connect();
    std::fs::remove_file(&server.socket).unwrap();
    let reconnected = wait_until(WAIT, "the socket's path bound again", || {
        ZdsZtunnel::connect(&server.socket).ok()
    });
    assert!(reconnected.wait_for_snapshot(WAIT));

    std::fs::remove_file(&server.socket).unwrap();
    let other_agent = std::os::unix::net::UnixListener::bind(&server.socket).unwrap();
    let other_file = std::fs::metadata(&server.socket).unwrap();
    wait_until(WAIT, "the socket's path taken back", || {
        let now = std::fs::metadata(&server.socket).ok()?;
        (now.ino() != other_file.ino()).then_some(())
    });
    drop(other_agent);
    let _third = server.connect();
    assert!(server.wait_connections(3), "the first connections go on");
    assert!(kept.events().iter().all(|event| *event != ZdsEvent::Closed));
}

#[test]
fn deleted_while_disconnected_is_not_in_the_next_snapshot() {
    let server = Server::start();
    server.add("gone", None).unwrap();
    server.add("kept", None).unwrap();
    // Nobody to tell: nothing fails.
    server.del("gone").unwrap();
    let client = server.connect();
    assert_eq!(
        client.events(),
        [
            ZdsEvent::Keep { uid: "kept".into() },
            ZdsEvent::SnapshotSent
        ]
    );
}

#[test]
fn add_goes_to_the_newest_connection_del_to_all() {
    let netns = privileged!(pod_netns("zdsnewest", Ipv4Addr::new(10, 251, 2, 1)));
    let server = Server::start();
    let old = server.connect();
    let new = server.connect();
    assert!(server.wait_connections(2));

    server.add("p", Some(&netns)).unwrap();
    assert_eq!(adds(&new), ["p"]);
    assert!(adds(&old).is_empty(), "{:?}", old.events());

    server.del("p").unwrap();
    for client in [&old, &new] {
        let del = ZdsEvent::Del { uid: "p".into() };
        assert_eq!(client.events().last(), Some(&del));
    }
    assert!(new.stand_in("p").is_none());
    assert_eq!(
        server
            .metrics()
            .value("weir_zds_acks_total", &[("message", "del")]),
        Some(2.0)
    );

    // Once the newest is gone, Adds go to the one left.
    new.disconnect();
    assert!(server.wait_connections(1));
    server.add("q", Some(&netns)).unwrap();
    assert_eq!(adds(&old), ["q"]);
}

#[test]
fn nack_is_an_error_and_the_connection_stays() {
    let netns = privileged!(pod_netns("zdsnack", Ipv4Addr::new(10, 251, 3, 1)));
    let server = Server::start();
    let client = server.connect();
    client.nack_next_add("no proxy for you");
    match server.add("p", Some(&netns)) {
        Err(ZdsError::Nack(error)) => assert_eq!(error, "no proxy for you"),
        other => panic!("expected a nack, got {other:?}"),
    }
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "add"), ("reason", "nack")]
        ),
        Some(1.0)
    );
    // Same connection, next Add goes through.
    server.add("p", Some(&netns)).unwrap();
    assert_eq!(adds(&client), ["p", "p"]);
    assert!(client.stand_in("p").is_some());
    assert_eq!(server.metrics().value("ztunnel_connected", &[]), Some(1.0));
}

/// ztunnel's Add is idempotent per namespace: the same pod added again in the same netns keeps
/// its proxy, in another netns (a sandbox made again) gets a new one.
#[test]
fn add_again_keeps_the_proxy_in_the_same_netns_only() {
    let (first, second) = privileged!(Ok((
        pod_netns("zdsagain1", Ipv4Addr::new(10, 251, 5, 1))?,
        pod_netns("zdsagain2", Ipv4Addr::new(10, 251, 5, 2))?,
    )));
    let server = Server::start();
    let client = server.connect();
    server.add("p", Some(&first)).unwrap();
    let proxy = client.stand_in("p").unwrap();
    server.add("p", Some(&first)).unwrap();
    assert!(Arc::ptr_eq(&client.stand_in("p").unwrap(), &proxy));

    server.add("p", Some(&second)).unwrap();
    let replaced = client.stand_in("p").unwrap();
    assert!(!Arc::ptr_eq(&replaced, &proxy));
    let reply = second
        .run(|| tcp_request((Ipv4Addr::new(10, 251, 5, 2), HBONE_PORT).into(), "CONNECT"))
        .unwrap();
    assert_eq!(reply.response, HBONE_REPLY);
    assert_eq!(adds(&client), ["p", "p", "p"]);
    assert!(!client
        .events()
        .iter()
        .any(|e| matches!(e, ZdsEvent::Drained { .. })));
}

#[test]
fn unacked_request_times_out_and_closes_the_connection() {
    let netns = privileged!(pod_netns("zdsmute", Ipv4Addr::new(10, 251, 4, 1)));
    let server = Server::start();
    let client = server.connect();
    client.never_ack();
    assert!(matches!(
        server.add("p", Some(&netns)),
        Err(ZdsError::Timeout)
    ));
    // Acks can no longer be matched to requests on it: it is closed.
    assert!(client.wait_for_close(WAIT), "{:?}", client.events());
    assert!(server.wait_connections(0));
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "add"), ("reason", "timeout")]
        ),
        Some(1.0)
    );
    // The pod stayed registered: the next ztunnel gets it in its snapshot.
    let next = server.connect();
    assert_eq!(adds(&next), ["p"]);
}

#[test]
fn no_hello_in_time_closes_the_connection() {
    let server = Server::start();
    let client = ZdsZtunnel::connect_with_hello(&server.socket, None).unwrap();
    assert!(client.wait_for_close(WAIT), "{:?}", client.events());
    assert_eq!(client.events(), [ZdsEvent::Closed]);
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "hello"), ("reason", "timeout")]
        ),
        Some(1.0)
    );
}

/// `ZdsHello { version: V1 }` on the wire.
const HELLO_V1: [u8; 2] = [0x08, 1];

/// Datagrams ztunnel never sends: undecodable, over 1024 bytes, carrying a descriptor.
fn bad_datagrams() -> [(&'static str, Vec<u8>, bool); 3] {
    [
        ("garbage", vec![0xff; 16], false),
        ("oversized", vec![0x0a; 2000], false),
        // A well-formed Ack, but with an fd.
        ("fd", vec![0x0a, 0], true),
    ]
}

#[test]
fn misbehaving_connections_are_closed_alone() {
    let server = Server::start();
    server.add("p", None).unwrap();
    let good = server.connect();
    let mut misbehaved = 0;

    for (what, bytes, with_fd) in bad_datagrams() {
        // As the hello.
        let bad = ZdsZtunnel::connect_with_hello(&server.socket, None).unwrap();
        bad.send_raw(&bytes, with_fd).unwrap();
        assert!(bad.wait_for_close(WAIT), "hello {what}: {:?}", bad.events());
        assert_eq!(bad.events(), [ZdsEvent::Closed], "hello {what}");

        // Unasked, in steady state (once the server has the snapshot's last ack: the stand-in
        // records SnapshotSent before it acks).
        let acked = server.snapshot_acks().unwrap_or(0.0);
        let bad = server.connect();
        wait_until(WAIT, "the snapshot's ack", || {
            server.snapshot_acks() == Some(acked + 1.0)
        });
        bad.send_raw(&bytes, with_fd).unwrap();
        assert!(
            bad.wait_for_close(WAIT),
            "unasked {what}: {:?}",
            bad.events()
        );

        // As the answer to a request (the snapshot's Keep): scripted before the hello.
        let bad = ZdsZtunnel::connect_with_hello(&server.socket, None).unwrap();
        bad.reply_always(ZdsReply::Raw {
            bytes: bytes.clone(),
            with_fd,
        });
        bad.send_raw(&HELLO_V1, false).unwrap();
        assert!(
            bad.wait_for_close(WAIT),
            "answer {what}: {:?}",
            bad.events()
        );
        let keep = ZdsEvent::Keep { uid: "p".into() };
        assert_eq!(bad.events(), [keep, ZdsEvent::Closed], "answer {what}");
        misbehaved += 1;

        // The well-behaved connection is untouched and still served.
        assert!(server.wait_connections(1), "after {what}");
        server.add(&format!("x-{what}"), None).unwrap();
        server.del(&format!("x-{what}")).unwrap();
        let del = ZdsEvent::Del {
            uid: format!("x-{what}"),
        };
        assert_eq!(good.events().last(), Some(&del), "after {what}");
    }
    assert_eq!(misbehaved, 3);
    assert_eq!(count(&good, |e| *e == ZdsEvent::Closed), 0);
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "unsolicited"), ("reason", "protocol")]
        ),
        Some(3.0)
    );
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "keep"), ("reason", "protocol")]
        ),
        Some(3.0)
    );
    assert_eq!(
        server.metrics().value(
            "weir_zds_errors_total",
            &[("message", "hello"), ("reason", "protocol")]
        ),
        Some(3.0)
    );
}

#[test]
fn request_on_a_closing_connection_fails_without_hanging() {
    let server = Server::start();
    let client = server.connect();
    server.add("p", None).unwrap();
    client.never_ack();
    // Del waits for the ack deadline, then reports the timeout (no netns needed).
    let started = Instant::now();
    assert!(matches!(server.del("p"), Err(ZdsError::Timeout)));
    assert!(started.elapsed() < WAIT);
    assert!(server.wait_connections(0));
    // No connection left: nothing to tell, nothing fails.
    server.del("p").unwrap();
}
