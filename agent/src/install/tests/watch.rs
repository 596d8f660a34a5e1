//! The watch: weir put back whenever another component rewrites the config or removes the
//! binary.
use super::*;

#[tokio::test]
async fn watch_puts_weir_back_after_a_rewrite() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    // Calico restarting rewrites its config, in place and without weir.
    node.write("10-calico.conflist", &calico_conflist());
    eventually(Duration::from_secs(1), "weir back", || {
        holds_weir_last(&node, "10-calico.conflist")
    })
    .await;
    assert_eq!(
        node.read("10-calico.conflist"),
        with_weir(calico_conflist())
    );
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().reinstalls == 1
    })
    .await;
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 1);
    assert!(installer.status().borrow().ready());
    assert_eq!(installer.inner.metrics.ready.get(), 1);

    watched.stop().await;
    assert!(!installer.status().borrow().watching);
    assert_eq!(installer.inner.metrics.ready.get(), 0);
}

#[tokio::test]
async fn watch_follows_a_new_higher_priority_file() {
    let node = Node::new();
    node.write("10-calico.conflist", &calico_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    // Written as careful CNIs write: a temp file renamed into place.
    node.write("tmp-cilium", &cilium_conflist());
    fs::rename(node.path("tmp-cilium"), node.path("05-cilium.conflist")).unwrap();
    eventually(Duration::from_secs(1), "weir in the new file", || {
        holds_weir_last(&node, "05-cilium.conflist")
    })
    .await;
    // The status is published after the file is written.
    let new_file = Some(node.path("05-cilium.conflist"));
    eventually(
        Duration::from_secs(1),
        "the status names the new file",
        || installer.status().borrow().config_file == new_file,
    )
    .await;
    assert!(installer.status().borrow().installed);
    watched.stop().await;
}

#[tokio::test]
async fn watch_restores_a_deleted_binary() {
    let node = Node::new();
    node.write("10-bridge.conflist", &bridge_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    fs::remove_file(node.binary()).unwrap();
    eventually(Duration::from_secs(1), "binary back", || {
        fs::read(node.binary()).ok() == fs::read(&node.plugin).ok()
    })
    .await;
    assert_eq!(mode(&node.binary()), 0o755);
    eventually(Duration::from_secs(1), "counted", || {
        installer.status().borrow().reinstalls == 1
    })
    .await;
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 0);
    watched.stop().await;
}

#[tokio::test]
async fn watch_waits_for_the_primary_cni() {
    let node = Node::new();
    let installer = node.installer();
    let watched = Watched::start(&installer).await;
    assert!(!installer.status().borrow().installed);

    node.write("10-bridge.conf", &lone_bridge_conf());
    eventually(Duration::from_secs(2), "installed", || {
        holds_weir_last(&node, "10-bridge.conflist")
    })
    .await;
    eventually(Duration::from_secs(1), "status", || {
        installer.status().borrow().ready()
    })
    .await;
    assert_eq!(node.entries(), ["10-bridge.conflist"]);
    assert_eq!(installer.status().borrow().reinstalls, 0, "a first install");
    watched.stop().await;
}

#[tokio::test]
async fn watch_keeps_up_with_repeated_rewrites() {
    let node = Node::new();
    node.write("05-cilium.conflist", &cilium_conflist());
    let installer = node.installer();
    installer.install().unwrap();
    let watched = Watched::start(&installer).await;

    for round in 1..=4 {
        node.write("05-cilium.conflist", &cilium_conflist());
        eventually(Duration::from_secs(2), "repaired", || {
            installer.status().borrow().reinstalls == round
        })
        .await;
        assert!(holds_weir_last(&node, "05-cilium.conflist"));
    }
    assert_eq!(installer.inner.metrics.config_rewrites.get(), 4);
    watched.stop().await;
}
