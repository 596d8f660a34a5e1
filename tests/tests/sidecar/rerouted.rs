//! Traffic a sidecar pod reroutes from another interface (a VM behind it): through the proxy
//! for included ranges, with VMs that share one address kept apart.
use super::*;

#[test]
fn tcp_from_a_rerouted_interface_goes_to_the_proxy_for_included_ranges() {
    rerouted_through_the_proxy(Interception::Redirect);
}

#[test]
fn tproxy_mode_reroutes_with_the_original_destination_as_local_address() {
    rerouted_through_the_proxy(Interception::Tproxy);
}

/// A VM behind a sidecar pod's rerouted interface (KubeVirt's): its TCP to the pod's included
/// outbound ranges goes to the pod's proxy on 15001 with the original destination, and the
/// VM's connection is with that destination, also where the interface is excluded too (istio's
/// rerouting rules come first); TCP to anything else goes where the pod routes it, and IPv6,
/// which the pod does not capture, is not rerouted. Kept while no agent runs and by the next
/// one; the pod's DEL takes it away. In REDIRECT mode the connection is translated to the
/// proxy at the pod's address; in TPROXY mode it is delivered with its destination, which the
/// proxy's transparent listener answers from.
fn rerouted_through_the_proxy(mode: Interception) {
    let Some(node) = Node::with_sidecar_pods(&[]) else {
        return;
    };
    let server = node.pod("default", "server").unwrap();
    let included = format!("{}/32", server.ipv4());
    let mut policy = ambient_policy();
    let mode_name = match mode {
        Interception::Redirect => "REDIRECT",
        Interception::Tproxy => "TPROXY",
    };
    let mut vm_host = sidecar_pod(
        &[
            ("sidecar.istio.io/interceptionMode", mode_name),
            ("istio.io/reroute-virtual-interfaces", "tap0"),
            ("traffic.sidecar.istio.io/excludeInterfaces", "tap0"),
            (
                "traffic.sidecar.istio.io/includeOutboundIPRanges",
                &included,
            ),
        ],
        &[],
    );
    if mode == Interception::Tproxy {
        vm_host.containers.last_mut().unwrap().run_as_user = Some(0);
    }
    policy.pods.insert("default/vmhost".into(), vm_host);
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server_app = EchoServer::app(&server).unwrap();
    let host = node.pod("default", "vmhost").unwrap();
    let host_app = EchoServer::app(&host).unwrap();
    let proxy = SidecarStandIn::start_with(&host, mode).unwrap();
    let qdisc = |interface: &str| {
        let args = [
            "-n",
            host.netns().name(),
            "qdisc",
            "show",
            "dev",
            interface,
            "ingress",
        ];
        (Process::new("tc").args(args).output().ok())
            .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
            .unwrap_or_default()
    };
    // Made after the pod's enrollment, as a VM's interface is: weir sets it up when it appears.
    // In REDIRECT mode it first appears under another name, as an interface weir captures
    // inbound on (one hook, an `ingress` qdisc), then is renamed into the rerouted list, where
    // weir needs an egress hook too: its qdisc becomes a clsact.
    let vm = match mode {
        Interception::Redirect => {
            let vm = VirtualMachine::behind(&host, "vm0");
            wait_until(WAIT, "weir's ingress qdisc on vm0", || {
                qdisc("vm0").starts_with("qdisc ingress ")
            });
            let in_host = |args: &[&str]| {
                let mut all = vec!["-n", host.netns().name(), "link", "set"];
                all.extend_from_slice(args);
                ip(&all).unwrap();
            };
            in_host(&["vm0", "down"]);
            in_host(&["vm0", "name", "tap0"]);
            in_host(&["tap0", "up"]);
            vm
        }
        Interception::Tproxy => VirtualMachine::behind(&host, "tap0"),
    };
    let through_proxy = |message: &str| -> bool {
        let Ok(reply) = vm.netns.run(|| tcp_request(server.app_v4(), message)) else {
            return false;
        };
        assert_eq!(reply.response, server_app.reply_to(message));
        assert_eq!(reply.peer_seen_by_client, server.app_v4());
        let seen = proxy.wait_for(
            |s| s.listener == OUTBOUND_PORT && s.peer == reply.local,
            WAIT,
        );
        let seen = seen.unwrap_or_else(|| panic!("{message:?} did not go through the proxy"));
        assert_eq!(seen.original_dst, Some(server.app_v4()), "SO_ORIGINAL_DST");
        true
    };
    assert!(try_wait_until(WAIT, || through_proxy("from the vm")).is_some());
    // An egress hook only where connections are translated.
    let hooks = match mode {
        Interception::Redirect => "qdisc clsact ",
        Interception::Tproxy => "qdisc ingress ",
    };
    assert!(qdisc("tap0").starts_with(hooks), "{}", qdisc("tap0"));
    assert!(
        qdisc("eth0").starts_with("qdisc ingress "),
        "{}",
        qdisc("eth0")
    );

    let reply = vm
        .netns
        .run(|| tcp_request(host.app_v4(), "not included"))
        .unwrap();
    assert_eq!(reply.response, host_app.reply_to("not included"));
    assert_eq!(
        host_app.received()[0].peer,
        reply.local,
        "straight to the app"
    );
    assert!(proxy.seen().iter().all(|s| s.peer != reply.local));
    let rules = |family: &str| ip_output(&["-n", host.netns().name(), family, "rule"]).unwrap();
    let rule = format!(
        "from all to {} iif tap0 ipproto tcp lookup 100",
        server.ipv4()
    );
    assert!(rules("-4").contains(&rule), "{}", rules("-4"));
    assert!(!rules("-6").contains("tap0"), "{}", rules("-6"));

    agent.stop().unwrap();
    assert!(through_proxy("while no agent runs"));
    let agent = node.start_agent();
    assert!(through_proxy("after a restart"));
    // Closed, the connections leave no translation behind.
    let freed = || translations(&node, &host) == 0;
    wait_until(WAIT, "closed connections' translations to go", freed);

    weir_only(
        &node,
        Command::Del,
        host.runtime_conf(),
        Some(host.prev_result()),
    )
    .unwrap();
    assert!(!rules("-4").contains("tap0"), "{}", rules("-4"));
    assert_eq!(translations(&node, &host), 0);
    let before = proxy.seen().len();
    let _ = vm
        .netns
        .run(|| tcp_request(server.app_v4(), "after the DEL"));
    assert_eq!(proxy.seen().len(), before);
    agent.stop().unwrap();
}

/// The REDIRECT-mode sidecar pods [`two_vms_at_one_address`] makes, each with a VM behind
/// `tap0`.
const VM_HOSTS: [&str; 2] = ["vm-a", "vm-b"];

/// Two REDIRECT-mode sidecar pods whose VMs have one address, as KubeVirt's masquerade binding
/// gives every VM the same one, and the server their included range holds, which keeps each
/// connection for as long as its client does.
struct TwoVms {
    node: Node,
    agent: Agent,
    _server_pod: Pod,
    server: EchoServer,
    pods: [Pod; 2],
    proxies: [SidecarStandIn; 2],
    vms: [VirtualMachine; 2],
}

/// A source port both VMs connect from in the tests below.
const VM_PORT: u16 = 40_000;

fn two_vms_at_one_address() -> Option<TwoVms> {
    let node = Node::with_sidecar_pods(&[])?;
    let server_pod = node.pod("default", "server").unwrap();
    let included = format!("{}/32", server_pod.ipv4());
    let mut policy = ambient_policy();
    for name in VM_HOSTS {
        let meta = sidecar_pod(
            &[
                ("traffic.sidecar.istio.io/kubevirtInterfaces", "tap0"),
                (
                    "traffic.sidecar.istio.io/includeOutboundIPRanges",
                    &included,
                ),
            ],
            &[],
        );
        policy.pods.insert(format!("default/{name}"), meta);
    }
    node.files.write_policy(&policy).unwrap();
    let agent = node.start_agent();
    let server =
        EchoServer::start_lasting(server_pod.netns(), "server", server_pod.app_v4()).unwrap();
    let pods = VM_HOSTS.map(|name| node.pod("default", name).unwrap());
    let proxies = pods
        .each_ref()
        .map(|pod| SidecarStandIn::start(pod).unwrap());
    let vms = pods
        .each_ref()
        .map(|pod| VirtualMachine::behind(pod, "tap0"));
    assert_eq!(vms[0].ipv4, vms[1].ipv4);
    // Until weir has set up a VM's interface, which it does once the interface appears, TCP
    // from the VM is refused.
    for (vm, proxy) in vms.iter().zip(&proxies) {
        let through_proxy = || {
            vm.netns
                .run(|| tcp_request(server.addr(), "ready"))
                .is_ok_and(|reply| proxy.seen().iter().any(|s| s.peer == reply.local))
        };
        assert!(try_wait_until(WAIT, through_proxy).is_some());
    }
    let vms = TwoVms {
        node,
        agent,
        _server_pod: server_pod,
        server,
        pods,
        proxies,
        vms,
    };
    vms.wait_for_no_translations();
    Some(vms)
}

impl TwoVms {
    /// Waits for the pods' closed connections' translations to go: each pod's map is empty.
    fn wait_for_no_translations(&self) {
        for pod in &self.pods {
            let freed = || translations(&self.node, pod) == 0;
            wait_until(WAIT, "closed connections' translations to go", freed);
        }
    }

    /// Connects VM `vm` from `port` to the server and waits for its pod's proxy to have it,
    /// with the server as its original destination; the connection is held.
    fn hold_connection(&self, vm: usize, port: u16) -> TcpStream {
        let server = self.server.addr();
        let stream = self.vms[vm]
            .netns
            .run(|| tcp_connect_from(port, server))
            .unwrap_or_else(|error| panic!("VM {}: {error}", VM_HOSTS[vm]));
        let from = stream.local_addr().unwrap();
        let seen = self.proxies[vm].wait_for(|s| s.peer == from, WAIT);
        let seen = seen.unwrap_or_else(|| panic!("{from} did not reach {}'s proxy", VM_HOSTS[vm]));
        assert_eq!(seen.original_dst, Some(server), "SO_ORIGINAL_DST");
        stream
    }

    /// Sends `message` on a held connection: the server answers it.
    fn exchange(&self, stream: &TcpStream, message: &str) {
        write_line(stream, message).unwrap();
        assert_eq!(read_line(stream).unwrap(), self.server.reply_to(message));
    }
}

/// Every KubeVirt VM has one address: a VM's connection is its own pod's, even from the same
/// port to the same destination as another pod's VM, and goes to its own pod's proxy with its
/// own original destination while the other's is open. Once both are closed (FIN both ways),
/// their translations are gone, as are those of a connection the VM resets.
#[test]
fn vms_at_one_address_reach_their_own_pods_proxy() {
    let Some(vms) = two_vms_at_one_address() else {
        return;
    };
    let held = vms.hold_connection(0, VM_PORT);
    let from = held.local_addr().unwrap();
    let other = vms.hold_connection(1, VM_PORT);
    assert_eq!(other.local_addr().unwrap(), from);
    let taken = vms.proxies[0]
        .seen()
        .iter()
        .filter(|s| s.peer == from)
        .count();
    assert_eq!(
        taken, 1,
        "{}'s proxy took the other VM's connection",
        VM_HOSTS[0]
    );
    vms.exchange(&other, "from b");
    vms.exchange(&held, "from a");
    drop((held, other));
    vms.wait_for_no_translations();

    let reset = vms.hold_connection(1, VM_PORT + 1);
    socket2::SockRef::from(&reset)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(reset);
    vms.wait_for_no_translations();
    vms.agent.stop().unwrap();
}

/// The MAC address of the pod's `interface`.
fn link_mac(pod: &Pod, interface: &str) -> [u8; 6] {
    let link = ip_output(&["-n", pod.netns().name(), "link", "show", interface]).unwrap();
    let mac = link
        .split_whitespace()
        .skip_while(|word| *word != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {link}"));
    let octets: Vec<u8> = mac
        .split(':')
        .map(|octet| u8::from_str_radix(octet, 16).unwrap())
        .collect();
    octets.try_into().unwrap()
}

/// A VM's SYN flood (half-open: from addresses beside its own, whose SYN-ACKs nobody answers)
/// past its pod's translation bound leaves another pod's open connection translated.
#[test]
fn a_vms_syn_flood_leaves_other_pods_translations_alone() {
    let Some(vms) = two_vms_at_one_address() else {
        return;
    };
    let held = vms.hold_connection(1, VM_PORT);
    let before = translations(&vms.node, &vms.pods[1]);
    assert_eq!(before, 2, "two per connection");
    let flood = REROUTE_NAT_ENTRIES / 2 + 1_000;
    let mac = link_mac(&vms.pods[0], "tap0");
    let spoofed = Ipv4Addr::new(192, 168, 77, 3);
    let syns = (0..flood).map(|n| raw::Syn {
        source: addr(spoofed, 1_024 + n as u16),
        destination: vms.server.addr(),
        shape: raw::VlanTagged(&[], mac),
        tcp: raw::Tcp::SYN,
    });
    let sent = vms.vms[0].netns.run(|| raw::flood(syns, mac)).unwrap();
    assert_eq!(sent, flood as usize);
    // Past its bound, the flooding pod's map recycles its own entries.
    let bound = REROUTE_NAT_ENTRIES as usize;
    let filled = || Some(translations(&vms.node, &vms.pods[0])).filter(|n| *n > bound / 2);
    let flooding = wait_until(WAIT, "the flood to fill its pod's map", filled);
    assert!(flooding <= bound, "{flooding} translations");
    assert_eq!(translations(&vms.node, &vms.pods[1]), before);
    vms.exchange(&held, "after the flood");
    vms.agent.stop().unwrap();
}
