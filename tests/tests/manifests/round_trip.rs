//! Every manifest under deploy/ reads into Kubernetes' types and back with no field unknown,
//! misspelt or lost.
use super::*;

#[test]
fn every_manifest_in_deploy_parses_into_kubernetes_types_with_no_unknown_or_lost_field() {
    let files = manifest_files();
    assert_eq!(
        files,
        vec![deploy_dir().join("weir.yaml")],
        "the manifests this test reads"
    );
    let all = manifests();
    assert_eq!(all.service_accounts.len(), 1);
    assert_eq!(all.cluster_roles.len(), 1);
    assert_eq!(all.cluster_role_bindings.len(), 1);
    assert_eq!(all.roles.len(), 1);
    assert_eq!(all.role_bindings.len(), 1);
    assert_eq!(all.daemonsets.len(), 1);
}

/// The check itself: a misspelt field and a field one level off are both reported.
#[test]
fn the_round_trip_reports_a_misspelt_or_misplaced_field() {
    let yaml = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: weir, namespce: x}\n\
                automountServiceAccountToken: true\nlabels: {a: b}\n";
    let value: Value = serde_norway::from_str(yaml).unwrap();
    let result = std::panic::catch_unwind(|| typed::<ServiceAccount>("inline", &value));
    let message = *result.unwrap_err().downcast::<String>().unwrap();
    assert!(
        message.contains(".metadata.namespce: unknown field"),
        "{message}"
    );
    assert!(message.contains(".labels: unknown field"), "{message}");
    assert!(
        !message.contains("automountServiceAccountToken"),
        "{message}"
    );
}
