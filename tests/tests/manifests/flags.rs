//! The DaemonSet's environment and arguments against the agent's own flags: every value one
//! the agent reads, every required one set.
use super::*;

#[test]
fn expected_values_are_the_agents_flag_defaults_and_envs() {
    let agent = AgentFlags::load();
    let flag = |long: &str| {
        agent
            .flags
            .get(long)
            .unwrap_or_else(|| panic!("weir-agent run has no {long}"))
    };
    let mut defaults = vec![
        ("--health-addr", expected::HEALTH_ADDR),
        ("--metrics-addr", expected::METRICS_ADDR),
        ("--system-namespace", expected::DAEMONSET.0),
    ];
    defaults.extend(
        expected::HOST_PATH_FLAGS
            .iter()
            .map(|(long, _, default, _)| (*long, *default)),
    );
    for (long, default) in defaults {
        assert_eq!(
            flag(long).default.as_deref(),
            Some(default),
            "{long} default"
        );
    }
    assert_eq!(
        flag("--cgroup").default,
        None,
        "--cgroup has no default: the cgroup2 mount point ({}) is used",
        expected::CGROUP
    );
    for (long, env, _, _) in expected::HOST_PATH_FLAGS {
        assert_eq!(flag(long).env.as_deref(), Some(*env), "{long} env");
    }
    let (long, env) = expected::SYSTEM_NAMESPACE_FLAG;
    assert_eq!(flag(long).env.as_deref(), Some(env), "{long} env");
    let (long, env, default) = expected::REPAIR_FLAG;
    assert_eq!(flag(long).env.as_deref(), Some(env), "{long} env");
    assert_eq!(
        flag(long).default.as_deref(),
        Some(default),
        "{long} default"
    );
}

/// Every env the DaemonSet sets is one the agent reads, for the flag `expected` says.
#[test]
fn every_env_var_the_daemonset_sets_is_a_flag_env_of_the_agent() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let agent = AgentFlags::load();
    let known = agent.envs();
    let unknown: Vec<&str> = container
        .env
        .iter()
        .flatten()
        .map(|env| env.name.as_str())
        .filter(|name| !known.contains(name))
        .collect();
    assert!(
        unknown.is_empty(),
        "the DaemonSet sets envs weir-agent run does not read: {unknown:?} (it reads {known:?})"
    );
    // And each of them belongs to the flag this test expects.
    let mut pairs: Vec<(&str, &str)> = expected::DOWNWARD_ENV
        .iter()
        .map(|(long, env, _)| (*long, *env))
        .collect();
    pairs.push(expected::DAEMONSET_NAME_FLAG);
    pairs.push(expected::SYSTEM_NAMESPACE_FLAG);
    let (long, env, _) = expected::LOG_FORMAT_FLAG;
    pairs.push((long, env));
    for (long, env) in pairs {
        assert_eq!(
            agent.flags.get(long).and_then(|flag| flag.env.as_deref()),
            Some(env),
            "{long}'s env"
        );
    }
}

/// The DaemonSet runs the cluster policy source (no policy file), and sets whatever flag
/// `weir-agent run` requires.
#[test]
fn the_daemonset_sets_every_flag_the_agent_requires() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let agent = AgentFlags::load();
    let args: Vec<&str> = container
        .args
        .iter()
        .flatten()
        .map(String::as_str)
        .collect();
    assert_eq!(args, ["run"], "the container runs `weir-agent run`");
    for long in &agent.required {
        let env = agent.flags[long].env.as_deref();
        let set = env.is_some_and(|env| env_value(container, env).is_some())
            || args.iter().any(|arg| arg.starts_with(long.as_str()));
        assert!(
            set,
            "weir-agent run requires {long} (env {env:?}), which the DaemonSet does not set"
        );
    }
}

#[test]
fn the_daemonset_has_the_agent_log_json() {
    let all = manifests();
    let (_, _, container) = daemonset(&all);
    let (long, env, format) = expected::LOG_FORMAT_FLAG;
    let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
    assert_eq!(var.value.as_deref(), Some(format), "{env}");
    let agent = AgentFlags::load();
    let values = &agent.flags[long].values;
    assert!(
        values.iter().any(|value| value == format),
        "{long} takes {format}: it takes {values:?}"
    );
}

#[test]
fn downward_api_env_tells_the_agent_its_node_pod_daemonset_and_namespace() {
    let all = manifests();
    let (ds, _, container) = daemonset(&all);
    for (_, env, field_path) in expected::DOWNWARD_ENV {
        let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
        assert_eq!(var.value, None, "{env} comes from the Downward API");
        let field = var
            .value_from
            .as_ref()
            .and_then(|from| from.field_ref.as_ref())
            .unwrap_or_else(|| panic!("{env} has no fieldRef"));
        assert_eq!(field.field_path, *field_path, "{env}");
    }
    let (namespace, name) = expected::DAEMONSET;
    assert_eq!(ds.metadata.namespace.as_deref(), Some(namespace));
    assert_eq!(ds.metadata.name.as_deref(), Some(name));
    for ((_, env), value) in [
        (expected::DAEMONSET_NAME_FLAG, name),
        (expected::SYSTEM_NAMESPACE_FLAG, namespace),
    ] {
        let var = env_value(container, env).unwrap_or_else(|| panic!("{env} is not set"));
        assert_eq!(var.value.as_deref(), Some(value), "{env}");
    }
}
