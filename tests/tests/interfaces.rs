//! A pod's interfaces beyond the ones it had at ADD: a VM's interface whose TCP
//! `istio.io/reroute-virtual-interfaces` sends to ztunnel's outbound listener, and interfaces and
//! addresses that appear (or go) after enrollment.
use std::{
    io::Write,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use socket2::{Domain, Socket, Type};
use weir_agent::{
    datapath::{pinned_pods, Datapath},
    workload::{PodOptions, SidecarRedirect, Workload},
};
use weir_common::{maps, ConnectionKey, Endpoint, IpKey, INBOUND_PORT, OUTBOUND_PORT};
use weir_tests::privileged;
use weir_tests::try_wait_until;
use weir_tests::{
    netns::{ip, NetNs},
    tcp_request,
    tunnel::Tunnel,
    virtual_machine::VirtualMachine,
    DatapathNode, EchoServer, Pod, TestNode, ZtunnelStandIn, APP_PORT,
};

const WAIT: Duration = Duration::from_secs(2);

fn rerouting(interfaces: &[&str]) -> PodOptions {
    PodOptions {
        reroute_interfaces: interfaces.iter().map(|name| name.to_string()).collect(),
        ..PodOptions::default()
    }
}

#[test]
fn tcp_from_a_rerouted_interface_lands_on_15001_with_the_original_destination() {
    let fixture = privileged!(DatapathNode::new());
    let (host, server, client) = (
        fixture.pod("vmhost"),
        fixture.pod("server"),
        fixture.pod("client"),
    );
    let vm = VirtualMachine::behind(&host, "tap0");
    let echo = EchoServer::app(&server).unwrap();
    let host_app = EchoServer::app(&host).unwrap();
    let ztunnel = ZtunnelStandIn::start(&host).unwrap();
    let datapath = fixture.enrolled(&host, PodOptions::default());
    let destinations = [
        SocketAddr::new(server.ipv4().into(), APP_PORT),
        SocketAddr::new(server.ipv6().into(), APP_PORT),
    ];
    let reached_15001 = |vm: &VirtualMachine| {
        ztunnel
            .seen()
            .into_iter()
            .filter(|seen| seen.listener == OUTBOUND_PORT && vm.ips().contains(&seen.peer.ip()))
            .count()
    };

    // Without the annotation the pod only routes the VM's traffic (here: it does not forward).
    for target in destinations {
        let _ = vm.netns.run(|| tcp_request(target, "direct"));
    }
    assert_eq!(reached_15001(&vm), 0);

    // Re-enrolled with the annotation: as if the pod had opened the connections.
    datapath
        .enroll(host.workload(rerouting(&[vm.interface])))
        .wait()
        .unwrap();
    for target in destinations {
        let reply = vm
            .netns
            .run(|| tcp_request(target, "from the vm"))
            .unwrap_or_else(|e| panic!("request to {target}: {e}"));
        assert_eq!(reply.response, echo.reply_to("from the vm"));
        let seen = ztunnel
            .wait_for(
                |s| s.listener == OUTBOUND_PORT && s.peer == reply.local,
                WAIT,
            )
            .unwrap_or_else(|| panic!("connection to {target} never reached 15001"));
        assert_eq!(seen.original_dst, Some(target), "SO_ORIGINAL_DST");
        assert!(echo
            .wait_for(
                |r| r.line == "from the vm" && host.ips().contains(&r.peer.ip()),
                WAIT
            )
            .is_some());
    }

    // The pod's own inbound is still ztunnel's inbound.
    let target = SocketAddr::new(host.ipv4().into(), APP_PORT);
    let reply = client.run(|| tcp_request(target, "inbound")).unwrap();
    assert_eq!(reply.response, host_app.reply_to("inbound"));
    assert!(ztunnel
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.peer == reply.local,
            WAIT
        )
        .is_some());

    // Re-enrolled without it again: back to plain routing.
    datapath
        .enroll(host.workload(PodOptions::default()))
        .wait()
        .unwrap();
    let before = reached_15001(&vm);
    for target in destinations {
        let _ = vm.netns.run(|| tcp_request(target, "direct"));
    }
    assert_eq!(reached_15001(&vm), before);
    datapath.uninstall().wait().unwrap();
}

/// Whether the pinned maps index `address` for `pod`, once the datapath has caught up with a
/// change it learns of asynchronously (or the deadline passes: the caller's assert then fails).
/// A VM controls the source of what it sends: it may claim another pod's address and port, the
/// key under which that pod's redirected connection keeps its original destination. Such a SYN
/// must neither overwrite that entry nor remove it.
#[test]
fn a_vm_cannot_overwrite_another_pods_original_destination() {
    let fixture = privileged!(DatapathNode::new());
    let (host, other, server) = (
        fixture.pod("host"),
        fixture.pod("other"),
        fixture.pod("server"),
    );
    let vm = VirtualMachine::behind(&host, "tap0");
    let _echo = EchoServer::app(&server).unwrap();
    let _ztunnel = ZtunnelStandIn::start(&host).unwrap();
    let datapath = fixture.enrolled(&host, rerouting(&[vm.interface]));

    // `other`'s connection from port 40000 to the server, as its connect hook recorded it.
    let key = ConnectionKey {
        client: Endpoint::new(IpKey::from_v4(other.ipv4().octets()), 40000),
        listener: Endpoint::new(IpKey::from_v4(server.ipv4().octets()), APP_PORT),
    };
    let recorded = Endpoint::new(IpKey::from_v4([10, 96, 0, 10]), 8443);
    let pinned = fixture.node().pinned_map(maps::CONN_ORIG_DST).unwrap();
    let mut original_destinations: aya::maps::HashMap<_, ConnectionKey, Endpoint> =
        aya::maps::HashMap::try_from(aya::maps::Map::LruHashMap(pinned)).unwrap();
    original_destinations.insert(key, recorded, 0).unwrap();

    // The VM sends a SYN from `other`'s address and port to the same destination.
    ip(&[
        "-n",
        vm.netns.name(),
        "address",
        "add",
        &format!("{}/32", other.ipv4()),
        "dev",
        "eth0",
    ])
    .unwrap();
    let target = SocketAddr::new(server.ipv4().into(), APP_PORT);
    let source = SocketAddr::new(other.ipv4().into(), 40000);
    vm.netns.run(|| {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.bind(&source.into()).unwrap();
        let _ = socket.connect_timeout(&target.into(), Duration::from_millis(500));
    });

    assert_eq!(original_destinations.get(&key, 0).ok(), Some(recorded));
    datapath.uninstall().wait().unwrap();
}

fn indexed_eventually(node: &TestNode, pod: &Pod, address: IpAddr, indexed: bool) -> bool {
    let is_indexed = || {
        let pods = pinned_pods(&node.datapath_config().pin_root)
            .unwrap()
            .unwrap_or_default();
        pods.iter()
            .any(|p| p.uid == pod.uid() && p.ips.contains(&address))
    };
    match try_wait_until(Duration::from_secs(5), || is_indexed() == indexed) {
        Some(()) => indexed,
        None => !indexed,
    }
}

/// Adds `address` to the pod's eth0, as a VM's tooling or an operator would.
fn add_to_eth0(pod: &Pod, address: Ipv4Addr) {
    let prefix = format!("{address}/32");
    ip(&[
        "-n",
        pod.netns().name(),
        "addr",
        "add",
        &prefix,
        "dev",
        "eth0",
    ])
    .unwrap();
}

/// A new inbound connection from `client` to `target` went through ztunnel's 15006 and on to
/// the app.
fn inbound_through_ztunnel(
    client: &NetNs,
    target: SocketAddr,
    ztunnel: &ZtunnelStandIn,
    app: &EchoServer,
) {
    let reply = client
        .run(|| tcp_request(target, "late"))
        .unwrap_or_else(|e| panic!("request to {target}: {e}"));
    assert_eq!(reply.response, app.reply_to("late"));
    let seen = ztunnel
        .wait_for(
            |s| s.listener == INBOUND_PORT && s.peer == reply.local,
            WAIT,
        )
        .unwrap_or_else(|| panic!("connection to {target} never reached 15006"));
    assert_eq!(seen.local, target);
}

#[test]
fn addresses_and_interfaces_added_after_enrollment_are_captured() {
    let fixture = privileged!(DatapathNode::new());
    let (server, client) = (fixture.pod("server"), fixture.pod("client"));
    // An address in the pod network's subnet, which host-local has not handed out.
    let [a, b, c, _] = server.ipv4().octets();
    let added = Ipv4Addr::new(a, b, c, 250);
    let secondary = Ipv4Addr::new(192, 168, 78, 1);
    let app = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start_in_netns(
        server.netns().open().unwrap(),
        &[server.ips().as_slice(), &[added.into(), secondary.into()]].concat(),
    )
    .unwrap();
    let datapath: Datapath = fixture.enrolled(&server, PodOptions::default());
    let server_ns = server.netns().name();

    // An address added to eth0.
    add_to_eth0(&server, added);
    assert!(indexed_eventually(
        fixture.node(),
        &server,
        added.into(),
        true
    ));
    inbound_through_ztunnel(
        client.netns(),
        SocketAddr::new(added.into(), APP_PORT),
        &ztunnel,
        &app,
    );

    // A secondary network: a new interface, with its peer in a namespace of its own.
    let network = NetNs::create("net1").unwrap();
    for command in [
        &[
            "-n",
            server_ns,
            "link",
            "add",
            "net1",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            network.name(),
        ][..],
        &[
            "-n",
            server_ns,
            "addr",
            "add",
            &format!("{secondary}/24"),
            "dev",
            "net1",
        ],
        &["-n", server_ns, "link", "set", "net1", "up"],
        &[
            "-n",
            network.name(),
            "addr",
            "add",
            "192.168.78.2/24",
            "dev",
            "eth0",
        ],
        &["-n", network.name(), "link", "set", "eth0", "up"],
    ] {
        ip(command).unwrap();
    }
    assert!(indexed_eventually(
        fixture.node(),
        &server,
        secondary.into(),
        true
    ));
    inbound_through_ztunnel(
        &network,
        SocketAddr::new(secondary.into(), APP_PORT),
        &ztunnel,
        &app,
    );

    // A removed address loses its entry; the pod's own IPs stay.
    ip(&[
        "-n",
        server_ns,
        "addr",
        "del",
        &format!("{added}/32"),
        "dev",
        "eth0",
    ])
    .unwrap();
    assert!(!indexed_eventually(
        fixture.node(),
        &server,
        added.into(),
        false
    ));
    assert!(indexed_eventually(
        fixture.node(),
        &server,
        server.ipv4().into(),
        true
    ));
    datapath.uninstall().wait().unwrap();
}

/// A pod with a tunnel of its own (wireguard, ipip, a VPN client's tun): packets arrive there
/// with no Ethernet header, and a new connection over it goes through ztunnel as one over eth0
/// does.
#[test]
fn inbound_over_an_interface_without_an_ethernet_header_goes_through_ztunnel() {
    let fixture = privileged!(DatapathNode::new());
    let server = fixture.pod("server");
    let peer = NetNs::create("tunpeer").unwrap();
    let (peer_ip, server_tunnel_ip) = (Ipv4Addr::new(10, 99, 0, 1), Ipv4Addr::new(10, 99, 0, 2));
    let _tunnel =
        Tunnel::between("tun0", (&peer, peer_ip), (server.netns(), server_tunnel_ip)).unwrap();
    let app = EchoServer::app(&server).unwrap();
    let ztunnel = ZtunnelStandIn::start_in_netns(
        server.netns().open().unwrap(),
        &[server.ips().as_slice(), &[server_tunnel_ip.into()]].concat(),
    )
    .unwrap();
    let datapath = fixture.enrolled(&server, PodOptions::default());
    inbound_through_ztunnel(
        &peer,
        SocketAddr::new(server_tunnel_ip.into(), APP_PORT),
        &ztunnel,
        &app,
    );
    // The audit expects that program there, and puts nothing back.
    assert_eq!(datapath.audit().wait().unwrap(), Vec::<&str>::new());
    datapath.uninstall().wait().unwrap();
}

#[test]
fn a_pod_taken_back_after_a_restart_is_followed_for_new_addresses() {
    let fixture = privileged!(DatapathNode::new());
    let server = fixture.pod("server");
    let workload = server.workload(PodOptions::default());
    fixture
        .enrolled(&server, PodOptions::default())
        .shutdown()
        .wait()
        .unwrap();
    // The restarted agent takes the pod back from the pins and its record.
    let datapath = fixture.start_datapath();
    let netns = datapath.adopt(server.uid(), Some(workload)).wait().unwrap();
    assert!(netns.is_some(), "the pod's netns is found again");

    let [a, b, c, _] = server.ipv4().octets();
    let added = Ipv4Addr::new(a, b, c, 251);
    add_to_eth0(&server, added);
    assert!(
        indexed_eventually(fixture.node(), &server, added.into(), true),
        "an address added after the restart is indexed for the pod"
    );
}

/// Changes `pod`'s eth0 addresses as fast as netlink takes them, as a container with
/// CAP_NET_ADMIN in a loop would: `flapped` added and removed `times` times, then `kept` added
/// and left. One `ip -batch`, so the changes come far faster than the owner re-reads the pod.
fn flap_addresses(pod: &Pod, flapped: Ipv4Addr, times: usize, kept: Ipv4Addr) {
    let mut batch = tempfile::NamedTempFile::new().unwrap();
    for _ in 0..times {
        writeln!(batch, "addr add {flapped}/32 dev eth0").unwrap();
        writeln!(batch, "addr del {flapped}/32 dev eth0").unwrap();
    }
    writeln!(batch, "addr add {kept}/32 dev eth0").unwrap();
    batch.flush().unwrap();
    let path = batch.path().to_str().unwrap();
    ip(&["-n", pod.netns().name(), "-batch", path]).unwrap();
}

/// A pod flapping its addresses costs the owner one pending re-read of that pod at a time,
/// however many changes it makes: another pod enrolled right after thousands of changes is
/// enrolled and indexed, and the flapping pod ends indexed as it left its addresses. (What the
/// other pod's enrollment waits is measured by the bench, side by side with a quiet node.)
#[test]
fn a_pod_flapping_its_addresses_ends_indexed_as_it_left_them_and_others_still_enroll() {
    let fixture = privileged!(DatapathNode::new());
    let (flapping, other) = (fixture.pod("flapping"), fixture.pod("other"));
    let [a, b, c, _] = flapping.ipv4().octets();
    let (flapped, kept) = (Ipv4Addr::new(a, b, c, 252), Ipv4Addr::new(a, b, c, 253));
    let datapath = fixture.enrolled(&flapping, PodOptions::default());

    flap_addresses(&flapping, flapped, 2_000, kept);
    datapath
        .enroll(other.workload(PodOptions::default()))
        .wait()
        .unwrap();
    assert!(indexed_eventually(
        fixture.node(),
        &flapping,
        kept.into(),
        true
    ));
    assert!(!indexed_eventually(
        fixture.node(),
        &flapping,
        flapped.into(),
        false
    ));
    assert!(indexed_eventually(
        fixture.node(),
        &other,
        other.ipv4().into(),
        true
    ));
    datapath.uninstall().wait().unwrap();
}

/// The route groups in a netlink socket's group mask.
const ROUTE_GROUPS: u32 = (libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE) as u32;
/// The link and address groups: what the interface watch's socket always listens to.
const INTERFACE_GROUPS: u32 =
    (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR) as u32;

/// The route groups the interface watch's socket (the one rtnetlink socket on `node` that
/// listens to interface changes) is in, from the kernel's table of netlink sockets.
fn watch_route_groups(node: &TestNode) -> u32 {
    let table = node.run(|| std::fs::read_to_string("/proc/thread-self/net/netlink").unwrap());
    let watches: Vec<u32> = table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|fields| fields.len() > 3 && fields[1] == "0")
        .filter_map(|fields| u32::from_str_radix(fields[3], 16).ok())
        .filter(|groups| groups & INTERFACE_GROUPS == INTERFACE_GROUPS)
        .collect();
    assert_eq!(watches.len(), 1, "one interface watch:\n{table}");
    watches[0] & ROUTE_GROUPS
}

/// For each change the interface watch hears from a pod's netns, the kernel looks that netns up
/// among all of the node's ids (one per pod): the watch listens to route changes, the most
/// frequent, only while a followed pod's capture depends on its routes (a sidecar pod's
/// `excludeInterfaces`), and stops at the audit after the last such pod left.
#[test]
fn route_changes_are_heard_only_while_a_pod_needs_them() {
    let fixture = privileged!(DatapathNode::new());
    let (ambient, sidecar) = (fixture.pod("ambient"), fixture.pod("sidecar"));
    let datapath = fixture.enrolled(&ambient, PodOptions::default());
    assert_eq!(watch_route_groups(fixture.node()), 0, "an ambient pod");

    let excluding = Workload {
        sidecar: Some(SidecarRedirect {
            exclude_interfaces: vec!["net1".into()],
            ..SidecarRedirect::default()
        }),
        ..sidecar.workload(PodOptions::default())
    };
    datapath.enroll(excluding).wait().unwrap();
    assert_eq!(
        watch_route_groups(fixture.node()),
        ROUTE_GROUPS,
        "a sidecar pod excluding an interface"
    );

    assert!(datapath.unenroll(sidecar.uid()).wait().unwrap());
    datapath.audit().wait().unwrap();
    assert_eq!(
        watch_route_groups(fixture.node()),
        0,
        "the sidecar pod gone"
    );
    datapath.uninstall().wait().unwrap();
}
