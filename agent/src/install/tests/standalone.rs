//! weir-cni as a network of its own, which Multus runs as an extra attachment: no chain, and no
//! primary config needed beside it.
use super::*;

const STANDALONE: &str = DEFAULT_STANDALONE_CONFIG_FILE;

fn standalone_network() -> Value {
    let mut network = weir_entry();
    network["name"] = json!("istio-cni");
    network["cniVersion"] = json!("1.0.0");
    network
}

#[test]
fn the_standalone_network_is_written_without_a_primary_config() {
    let node = Node::new();
    let installer = node.standalone_installer();
    assert_eq!(
        installer.install().unwrap(),
        installed(node.path(STANDALONE))
    );
    assert_eq!(node.read(STANDALONE), standalone_network());
    assert_eq!(mode(&node.path(STANDALONE)), 0o644);
    assert!(matches!(
        installer.install().unwrap(),
        InstallOutcome::AlreadyInstalled { .. }
    ));
}

#[test]
fn a_standalone_name_the_runtime_would_load_first_is_refused() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = Installer::new(InstallConfig {
        placement: CniPlacement {
            placement: Placement::Standalone,
            standalone_file: "00-istio-cni.conf".into(),
            ..CniPlacement::default()
        },
        ..node.installer().inner.config.clone()
    });
    let message = format!("{:#}", installer.install().unwrap_err());
    assert!(message.contains("would sort before"), "{message}");
    assert!(
        message.contains("--standalone-cni-config-filename"),
        "{message}"
    );
    assert_eq!(node.entries(), ["10-calico.conflist"]);
}

#[test]
fn switching_to_and_from_standalone_moves_weir_out_of_and_back_into_the_chain() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    node.installer().install().unwrap();
    node.owning_installer().install().unwrap();
    assert_eq!(
        node.entries(),
        [DEFAULT_OWNED_CONFIG_FILE, "10-calico.conflist"]
    );

    node.standalone_installer().install().unwrap();
    assert_eq!(node.entries(), ["10-calico.conflist", STANDALONE]);
    assert_eq!(node.read("10-calico.conflist"), calico_conflist());
    assert_eq!(node.read(STANDALONE), standalone_network());

    node.installer().install().unwrap();
    assert_eq!(node.entries(), ["10-calico.conflist"]);
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
}

#[test]
fn uninstall_removes_the_standalone_network_and_only_weirs() {
    let node = Node::new();
    let installer = node.standalone_installer();
    installer.install().unwrap();
    installer.uninstall().unwrap();
    assert!(node.entries().is_empty());
    assert!(!node.binary().exists());

    node.write(STANDALONE, &lone_bridge_conf());
    installer.uninstall().unwrap();
    assert_eq!(node.read(STANDALONE), lone_bridge_conf());
}

#[tokio::test]
async fn a_deleted_standalone_network_comes_back() {
    let node = Node::new();
    let installer = node.standalone_installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;
    fs::remove_file(node.path(STANDALONE)).unwrap();
    eventually(Duration::from_secs(1), "the network back", || {
        fs::read(node.path(STANDALONE)).is_ok_and(|bytes| {
            serde_json::from_slice::<Value>(&bytes).ok() == Some(standalone_network())
        })
    })
    .await;
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().config_rewrites == 1
    })
    .await;
    watched.stop().await;
}
