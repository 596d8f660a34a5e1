//! weir's own conflist: the primary CNI's chain with weir appended, in a file the runtime loads
//! first, the primary's file left as its CNI wrote it.
use super::*;

const OWNED: &str = DEFAULT_OWNED_CONFIG_FILE;

#[test]
fn the_owned_file_holds_the_primary_chain_and_the_primary_file_is_untouched() {
    for (name, original) in [
        ("10-calico.conflist", calico_conflist()),
        ("05-cilium.conflist", cilium_conflist()),
    ] {
        let node = Node::new();
        node.write(name, &original);
        let installer = node.owning_installer();
        assert_eq!(installer.install().unwrap(), installed(node.path(OWNED)));
        assert_eq!(node.read(OWNED), with_weir(original.clone()), "{name}");
        assert_eq!(node.read(name), original, "{name}");
        assert_eq!(node.entries(), [OWNED, name]);
        assert_eq!(mode(&node.path(OWNED)), mode(&node.path(name)));
        assert!(matches!(
            installer.install().unwrap(),
            InstallOutcome::AlreadyInstalled { .. }
        ));
    }
}

#[test]
fn a_lone_conf_is_chained_as_the_runtime_wraps_it_and_left_in_place() {
    let node = Node::new();
    node.write("10-bridge.conf", &lone_bridge_conf());
    node.owning_installer().install().unwrap();
    assert_eq!(node.entries(), [OWNED, "10-bridge.conf"]);
    assert_eq!(
        node.read(OWNED),
        json!({"cniVersion": "0.4.0", "name": "mynet",
               "plugins": [lone_bridge_conf(), weir_entry()]})
    );
}

#[test]
fn an_owned_name_the_runtime_would_not_load_first_is_refused() {
    let node = Node::new();
    node.write("01-flannel.conflist", &bridge_conflist());
    let error = node.owning_installer().install().unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("01-flannel.conflist sorts before it"),
        "{message}"
    );
    assert!(message.contains("--owned-cni-config-filename"), "{message}");
    assert_eq!(node.entries(), ["01-flannel.conflist"]);
    assert_eq!(node.read("01-flannel.conflist"), bridge_conflist());
}

#[test]
fn switching_modes_moves_weir_between_the_files() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    node.installer().install().unwrap();
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );

    node.owning_installer().install().unwrap();
    assert_eq!(node.read("10-calico.conflist"), calico_conflist());
    assert_eq!(node.read(OWNED), with_weir(calico_conflist()));

    node.installer().install().unwrap();
    assert_eq!(node.entries(), ["10-calico.conflist"]);
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn a_file_of_that_name_without_weir_is_not_weirs_to_remove() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    node.write(OWNED, &cilium_conflist());
    node.installer().uninstall().unwrap();
    assert_eq!(node.read(OWNED), cilium_conflist());
}

#[test]
fn uninstall_removes_the_owned_file_and_leaves_the_primary() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.owning_installer();
    installer.install().unwrap();
    installer.uninstall().unwrap();
    assert_eq!(node.entries(), ["10-calico.conflist"]);
    assert_eq!(node.read("10-calico.conflist"), calico_conflist());
    assert!(!node.binary().exists());
}

#[tokio::test]
async fn the_owned_file_follows_the_primary_and_comes_back_when_deleted() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.owning_installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    // Calico's new settings reach the pods started after them, through weir's file.
    let mut updated = calico_conflist();
    updated["plugins"][0]["mtu"] = json!(1400);
    node.write("10-calico.conflist", &updated);
    eventually(Duration::from_secs(1), "the owned file follows", || {
        fs::read(node.path(OWNED)).is_ok_and(|bytes| {
            serde_json::from_slice::<Value>(&bytes).ok() == Some(with_weir(updated.clone()))
        })
    })
    .await;
    assert_eq!(node.read("10-calico.conflist"), updated);

    fs::remove_file(node.path(OWNED)).unwrap();
    eventually(Duration::from_secs(1), "the owned file back", || {
        holds_weir_last(&node, OWNED)
    })
    .await;
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().config_rewrites == 1
    })
    .await;
    assert_eq!(
        installer.status().borrow().config_file,
        Some(node.path(OWNED))
    );
    watched.stop().await;
}
