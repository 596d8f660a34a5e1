//! Installing into the node's CNI config, copying the binary, uninstalling, and the metrics.
use super::*;

#[test]
fn inserts_weir_last_keeping_every_other_field_and_the_order() {
    for (name, original) in [
        ("10-bridge.conflist", bridge_conflist()),
        ("10-calico.conflist", calico_conflist()),
        ("05-cilium.conflist", cilium_conflist()),
    ] {
        let node = Node::new();
        let path = node.write(name, &original);
        assert_eq!(node.installer().install().unwrap(), installed(path));
        assert_eq!(node.read(name), with_weir(original), "{name}");
    }
}

#[test]
fn keeps_fields_libcni_gives_meaning_to() {
    let node = Node::new();
    let mut original = bridge_conflist();
    original["disableCheck"] = json!("true");
    original["disableGC"] = json!(true);
    original["cniVersions"] = json!(["0.4.0", "1.0.0"]);
    original["x-vendor"] = json!({"anything": [1, 2.5, null]});
    node.write("10-bridge.conflist", &original);
    node.installer().install().unwrap();
    assert_eq!(node.read("10-bridge.conflist"), with_weir(original));
}

#[test]
fn wraps_a_lone_conf_into_a_conflist() {
    let node = Node::new();
    let conf = lone_bridge_conf();
    node.write("10-bridge.conf", &conf);
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome, installed(node.path("10-bridge.conflist")));
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(
        node.read("10-bridge.conflist"),
        json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [conf, weir_entry()]})
    );
}

#[test]
fn wraps_a_json_config_into_a_conflist() {
    let node = Node::new();
    node.write(
        "99-loopback.json",
        &json!({"cniVersion": "1.0.0", "type": "loopback"}),
    );
    node.installer().install().unwrap();
    assert_eq!(node.entries(), ["99-loopback.conflist"]);
    assert_eq!(
        node.read("99-loopback.conflist"),
        json!({"cniVersion": "1.0.0", "name": "",
               "plugins": [{"cniVersion": "1.0.0", "type": "loopback"}, weir_entry()]})
    );
}

#[test]
fn install_is_idempotent() {
    let node = Node::new();
    let path = node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let first = fs::read(&path).unwrap();
    let inode = fs::metadata(&path).unwrap().ino();
    assert_eq!(
        installer.install().unwrap(),
        InstallOutcome::AlreadyInstalled { file: path.clone() }
    );
    assert_eq!(fs::read(&path).unwrap(), first);
    assert_eq!(fs::metadata(&path).unwrap().ino(), inode, "not rewritten");
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn moves_a_misplaced_entry_last_and_updates_a_stale_one() {
    let node = Node::new();
    let mut config = calico_conflist();
    let stale = json!({"type": PLUGIN, "agent_socket": "/old.sock"});
    config["plugins"].as_array_mut().unwrap().insert(1, stale);
    node.write("10-calico.conflist", &config);
    node.installer().install().unwrap();
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn installs_into_the_first_file_in_lexical_order() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let calico_bytes = fs::read(node.path("10-calico.conflist")).unwrap();
    node.write("05-cilium.conflist", &cilium_conflist());
    node.write("README", &json!("not a config"));
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome.file(), node.path("05-cilium.conflist"));
    assert_eq!(
        node.read("05-cilium.conflist"),
        with_weir(cilium_conflist())
    );
    assert_eq!(
        fs::read(node.path("10-calico.conflist")).unwrap(),
        calico_bytes
    );
}

#[test]
fn leaves_an_invalid_file_alone_and_uses_the_next() {
    let node = Node::new();
    let broken = node.path("00-broken.conflist");
    fs::write(&broken, b"{\"name\": \"half-writ").unwrap();
    let not_a_list = node.write("01-list-in-a.conf", &calico_conflist());
    let before = fs::read(&not_a_list).unwrap();
    node.write("10-bridge.conflist", &bridge_conflist());
    let outcome = node.installer().install().unwrap();
    assert_eq!(outcome.file(), node.path("10-bridge.conflist"));
    assert_eq!(fs::read(&broken).unwrap(), b"{\"name\": \"half-writ");
    assert_eq!(fs::read(&not_a_list).unwrap(), before);
}

#[test]
fn fails_while_there_is_no_config() {
    let node = Node::new();
    fs::write(node.path("00-broken.conflist"), b"garbage").unwrap();
    let installer = node.installer();
    let error = installer.install().unwrap_err();
    assert!(error.is::<NoNetworkConfig>(), "{error:#}");
    assert!(!installer.status().borrow().installed);
    assert_eq!(
        fs::read(node.path("00-broken.conflist")).unwrap(),
        b"garbage"
    );
}

#[test]
fn a_missing_net_dir_means_no_config_yet() {
    let node = Node::new();
    fs::remove_dir(&node.net).unwrap();
    let error = node.installer().install().unwrap_err();
    assert!(error.is::<NoNetworkConfig>(), "{error:#}");
    node.installer().uninstall().unwrap();
}

#[test]
fn keeps_the_file_mode() {
    let node = Node::new();
    let path = node.write("10-bridge.conflist", &bridge_conflist());
    fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
    let conf = node.write("20-lone.conf", &lone_bridge_conf());
    fs::set_permissions(&conf, fs::Permissions::from_mode(0o600)).unwrap();
    node.installer().install().unwrap();
    assert_eq!(mode(&path), 0o640);

    fs::remove_file(&path).unwrap();
    node.installer().install().unwrap();
    assert_eq!(mode(&node.path("20-lone.conflist")), 0o600);
}

#[test]
fn follows_a_symlinked_conflist() {
    let node = Node::new();
    let real_dir = node.net.parent().unwrap().join("real");
    fs::create_dir(&real_dir).unwrap();
    let target = real_dir.join("calico.conflist");
    fs::write(&target, calico_conflist().to_string()).unwrap();
    let link = node.path("10-calico.conflist");
    symlink(&target, &link).unwrap();
    node.installer().install().unwrap();
    assert!(fs::symlink_metadata(&link).unwrap().is_symlink());
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn copies_the_binary_executable_only_when_it_differs() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let binary = node.binary();
    assert_eq!(fs::read(&binary).unwrap(), fs::read(&node.plugin).unwrap());
    assert_eq!(mode(&binary), 0o755);
    let inode = fs::metadata(&binary).unwrap().ino();

    installer.install().unwrap();
    assert_eq!(fs::metadata(&binary).unwrap().ino(), inode);

    fs::write(&node.plugin, b"#!/bin/sh\necho weir v2\n").unwrap();
    let outcome = installer.install().unwrap();
    assert!(matches!(
        outcome,
        InstallOutcome::Installed {
            binary_changed: true,
            config_changed: false,
            ..
        }
    ));
    assert_eq!(fs::read(&binary).unwrap(), b"#!/bin/sh\necho weir v2\n");

    // Compared chunk by chunk: a change of the same length, or past the first chunk, counts.
    let mut large = vec![b'#'; 200 * 1024];
    for version in [b"#!/bin/sh\necho weir v3\n".to_vec(), large.clone(), {
        *large.last_mut().unwrap() = b'\n';
        large
    }] {
        fs::write(&node.plugin, &version).unwrap();
        let outcome = installer.install().unwrap();
        assert!(matches!(
            outcome,
            InstallOutcome::Installed {
                binary_changed: true,
                ..
            }
        ));
        assert_eq!(fs::read(&binary).unwrap(), version);
        let unchanged = installer.install().unwrap();
        assert!(matches!(unchanged, InstallOutcome::AlreadyInstalled { .. }));
    }
}

#[test]
fn uninstall_restores_the_original_config() {
    let node = Node::new();
    let mut original = calico_conflist();
    original["disableCheck"] = json!(true);
    node.write("10-calico.conflist", &original);
    let installer = node.installer();
    installer.install().unwrap();

    installer.uninstall().unwrap();
    assert_eq!(node.read("10-calico.conflist"), original);
    assert!(!node.binary().exists());
    assert!(!installer.status().borrow().installed);

    installer.uninstall().unwrap();
    assert_eq!(node.read("10-calico.conflist"), original);
}

#[test]
fn uninstall_leaves_a_wrapped_conf_as_an_equivalent_conflist() {
    let node = Node::new();
    node.write("10-bridge.conf", &lone_bridge_conf());
    let installer = node.installer();
    installer.install().unwrap();
    installer.uninstall().unwrap();
    assert_eq!(
        node.read("10-bridge.conflist"),
        json!({"cniVersion": "0.4.0", "name": "mynet", "plugins": [lone_bridge_conf()]})
    );
}

#[test]
fn uninstall_cleans_every_file_and_drops_a_list_left_empty() {
    let node = Node::new();
    node.write("05-cilium.conflist", &with_weir(cilium_conflist()));
    node.write(
        "10-only-weir.conflist",
        &json!({"name": "n", "plugins": [weir_entry()]}),
    );
    fs::write(node.path("20-broken.conflist"), b"{").unwrap();
    node.installer().uninstall().unwrap();
    assert_eq!(node.entries(), ["05-cilium.conflist", "20-broken.conflist"]);
    assert_eq!(node.read("05-cilium.conflist"), cilium_conflist());
}

#[test]
fn metrics_use_istio_names() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    let mut registry = Registry::default();
    installer.register_metrics(&mut registry);
    installer.install().unwrap();
    installer.install().unwrap();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("istio_cni_installs_total{result=\"SUCCESS\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("istio_cni_install_ready 0\n"),
        "not watched: {text}"
    );
    assert!(
        text.contains("weir_cni_config_rewrites_total 0\n"),
        "{text}"
    );
}
