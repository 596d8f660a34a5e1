//! The agent's access: its service account bound to every role, and the rules exactly the
//! requests the agent makes.
use super::*;

#[test]
fn the_daemonsets_service_account_exists_and_is_bound_to_every_role() {
    let all = manifests();
    let (ds, pod, _) = daemonset(&all);
    let namespace = ds.metadata.namespace.as_deref().unwrap();
    let account = pod
        .service_account_name
        .as_deref()
        .expect("the DaemonSet names its ServiceAccount");
    assert!(
        all.service_accounts.iter().any(|sa| {
            sa.metadata.name.as_deref() == Some(account)
                && sa.metadata.namespace.as_deref() == Some(namespace)
        }),
        "ServiceAccount {namespace}/{account} is in deploy/"
    );
    let is_account = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == account
                && s.namespace.as_deref() == Some(namespace)
        })
    };
    for role in &all.cluster_roles {
        let name = role.metadata.name.as_deref().unwrap();
        assert!(
            all.cluster_role_bindings.iter().any(|b| {
                b.role_ref.kind == "ClusterRole"
                    && b.role_ref.name == name
                    && b.role_ref.api_group.as_deref() == Some("rbac.authorization.k8s.io")
                    && is_account(&b.subjects)
            }),
            "ClusterRole {name} is bound to {namespace}/{account} by a ClusterRoleBinding"
        );
    }
    for role in &all.roles {
        let name = role.metadata.name.as_deref().unwrap();
        assert_eq!(
            role.metadata.namespace.as_deref(),
            Some(namespace),
            "Role {name}"
        );
        assert!(
            all.role_bindings.iter().any(|b| {
                b.metadata.namespace.as_deref() == Some(namespace)
                    && b.role_ref.kind == "Role"
                    && b.role_ref.name == name
                    && b.role_ref.api_group.as_deref() == Some("rbac.authorization.k8s.io")
                    && is_account(&b.subjects)
            }),
            "Role {name} is bound to {namespace}/{account} by a RoleBinding in {namespace}"
        );
    }
    // And every binding binds a role that is here.
    for binding in &all.cluster_role_bindings {
        assert!(all
            .cluster_roles
            .iter()
            .any(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str())));
    }
    for binding in &all.role_bindings {
        assert!(all
            .roles
            .iter()
            .any(|r| r.metadata.name.as_deref() == Some(binding.role_ref.name.as_str())));
    }
}

/// One verb on one resource: (scope, apiGroup, resource, verb, resourceNames).
type Grant = (Scope, String, String, String, Vec<String>);

fn grants(scope: Scope, rules: &[PolicyRule]) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for rule in rules {
        assert!(
            rule.non_resource_urls.is_none(),
            "no nonResourceURLs: {rule:?}"
        );
        let mut names = rule.resource_names.clone().unwrap_or_default();
        names.sort();
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    let grant = (
                        scope,
                        group.clone(),
                        resource.clone(),
                        verb.clone(),
                        names.clone(),
                    );
                    assert!(out.insert(grant.clone()), "granted twice: {grant:?}");
                }
            }
        }
    }
    out
}

#[test]
fn rbac_rules_are_exactly_the_requests_the_agent_makes() {
    let all = manifests();
    let (ds, _, container) = daemonset(&all);
    let mut granted = BTreeSet::new();
    for role in &all.cluster_roles {
        granted.extend(grants(
            Scope::Cluster,
            role.rules.as_deref().unwrap_or_default(),
        ));
    }
    for role in &all.roles {
        granted.extend(grants(
            Scope::Namespace,
            role.rules.as_deref().unwrap_or_default(),
        ));
    }
    let mut wanted = BTreeSet::new();
    for rule in expected::RBAC {
        for verb in rule.verbs {
            wanted.insert((
                rule.scope,
                rule.group.to_owned(),
                rule.resource.to_owned(),
                verb.to_string(),
                rule.names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
            ));
        }
    }
    let extra: Vec<_> = granted.difference(&wanted).collect();
    let missing: Vec<_> = wanted.difference(&granted).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "RBAC differs from what the agent uses:\n  granted, not used: {extra:?}\n  used, not granted: {missing:?}"
    );
    for grant in &granted {
        assert!(
            !grant.1.contains('*') && !grant.2.contains('*') && !grant.3.contains('*'),
            "no wildcards: {grant:?}"
        );
    }
    // The Role's resourceNames is the DaemonSet the agent is told to watch.
    let name = ds.metadata.name.clone().unwrap();
    let (_, env) = expected::DAEMONSET_NAME_FLAG;
    assert_eq!(
        env_value(container, env).and_then(|v| v.value.clone()),
        Some(name.clone())
    );
    for grant in granted.iter().filter(|g| g.2 == "daemonsets") {
        assert_eq!(
            grant.4,
            std::slice::from_ref(&name),
            "{grant:?} names the DaemonSet"
        );
    }
}

/// `delete` on pods, for `--repair-broken-pods=delete` alone (`Repair::delete` in
/// agent/src/cluster/repair.rs), comes from its own manifest, bound to the agent's account.
#[test]
fn pod_deletion_is_granted_only_by_the_repair_delete_manifest() {
    let text = std::fs::read_to_string(deploy_dir().join("repair-delete/rbac.yaml")).unwrap();
    let (mut roles, mut bindings) = (Vec::new(), Vec::new());
    for document in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(document).unwrap();
        match value["kind"].as_str() {
            Some("ClusterRole") => roles.push(typed::<ClusterRole>("repair-delete", &value)),
            Some("ClusterRoleBinding") => {
                bindings.push(typed::<ClusterRoleBinding>("repair-delete", &value))
            }
            other => panic!("unexpected {other:?} in repair-delete/rbac.yaml"),
        }
    }
    let [role] = &roles[..] else {
        panic!("one ClusterRole")
    };
    let granted = grants(Scope::Cluster, role.rules.as_deref().unwrap_or_default());
    let delete = (
        Scope::Cluster,
        String::new(),
        "pods".to_owned(),
        "delete".to_owned(),
        vec![],
    );
    assert_eq!(granted, BTreeSet::from([delete]));
    let [binding] = &bindings[..] else {
        panic!("one ClusterRoleBinding")
    };
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    let all = manifests();
    let account = &all.service_accounts[0].metadata;
    let subjects = binding.subjects.as_deref().unwrap_or_default();
    assert!(subjects
        .iter()
        .any(|subject| subject.kind == "ServiceAccount"
            && Some(&subject.name) == account.name.as_ref()
            && subject.namespace == account.namespace));
}
