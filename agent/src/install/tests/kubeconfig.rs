//! The plugin's kubeconfig: written, rewritten on token rotation, removed, and watched.
use super::*;

#[test]
fn writes_the_plugins_kubeconfig_0600_and_names_it_in_the_entry() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    node.installer_with_service_account().install().unwrap();

    let kubeconfig = node.kubeconfig();
    assert_eq!(mode(&kubeconfig), 0o600, "it holds the agent's token");
    let written: Value = serde_json::from_slice(&fs::read(&kubeconfig).unwrap()).unwrap();
    assert_eq!(
        written,
        json!({"apiVersion": "v1", "kind": "Config",
               "clusters": [{"name": "local", "cluster": {
                   "server": "https://10.96.0.1:443",
                   "certificate-authority-data": base64_of(CA_PEM)}}],
               "users": [{"name": "weir-cni", "user": {"token": "token-1"}}],
               "contexts": [{"name": "weir-cni",
                             "context": {"cluster": "local", "user": "weir-cni"}}],
               "current-context": "weir-cni"})
    );
    let mut entry = weir_entry();
    entry["kubeconfig"] = json!(kubeconfig);
    let mut expected = bridge_conflist();
    expected["plugins"].as_array_mut().unwrap().push(entry);
    assert_eq!(node.read("10-bridge.conflist"), expected);
    // Not a network config: libcni never loads it, and weir never takes it for one.
    assert_eq!(
        node.installer_with_service_account().install().unwrap(),
        InstallOutcome::AlreadyInstalled {
            file: node.path("10-bridge.conflist")
        }
    );
}

fn base64_of(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[test]
fn rewrites_the_kubeconfig_when_the_token_rotates() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    installer.install().unwrap();
    let inode = fs::metadata(node.kubeconfig()).unwrap().ino();
    installer.install().unwrap();
    assert_eq!(
        fs::metadata(node.kubeconfig()).unwrap().ino(),
        inode,
        "unchanged: not rewritten"
    );

    node.rotate_token("token-2");
    installer.install().unwrap();
    let written: Value = serde_json::from_slice(&fs::read(node.kubeconfig()).unwrap()).unwrap();
    assert_eq!(written["users"][0]["user"]["token"], "token-2");
    assert_eq!(mode(&node.kubeconfig()), 0o600);

    // Loosened by someone: made 0600 again.
    fs::set_permissions(node.kubeconfig(), fs::Permissions::from_mode(0o644)).unwrap();
    installer.install().unwrap();
    assert_eq!(mode(&node.kubeconfig()), 0o600);
}

#[test]
fn a_missing_token_holds_back_the_kubeconfig_not_the_entry() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    fs::remove_file(node._root.path().join("serviceaccount/token")).unwrap();
    installer.install().unwrap();
    assert!(!node.kubeconfig().exists());
    assert!(holds_weir_last_with_kubeconfig(&node, "10-bridge.conflist"));
}

fn holds_weir_last_with_kubeconfig(node: &Node, name: &str) -> bool {
    let config = node.read(name);
    let last = config["plugins"].as_array().and_then(|p| p.last()).cloned();
    last.is_some_and(|last| {
        last["type"] == PLUGIN && last["kubeconfig"] == json!(node.kubeconfig())
    })
}

#[test]
fn uninstall_removes_the_kubeconfig() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    node.installer_with_service_account().install().unwrap();
    assert!(node.kubeconfig().exists());
    // `weir-agent uninstall` knows no service account, and removes it all the same.
    node.installer().uninstall().unwrap();
    assert!(!node.kubeconfig().exists());
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(node.read("10-bridge.conflist"), bridge_conflist());
}

#[tokio::test]
async fn watch_restores_a_deleted_kubeconfig() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer_with_service_account();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    fs::remove_file(node.kubeconfig()).unwrap();
    eventually(Duration::from_secs(2), "kubeconfig back", || {
        node.kubeconfig().exists()
    })
    .await;
    assert_eq!(mode(&node.kubeconfig()), 0o600);
    watched.stop().await;
}
