//! The Helm chart at `deploy/helm/floodgate`, checked with a real `helm` binary: it lints, it renders
//! with its defaults and with `ci/production-values.yaml`, the rendered manifests carry what the
//! agents and the rules service need (the config file, the host socket directory, the secrets'
//! mounts, the disruption budgets), and its values schema refuses a bad value. Also: every service
//! of `deploy/compose/compose.yaml` has a healthcheck.
//!
//! `helm` is `$FLOODGATE_HELM`, else `helm` on the `PATH`. Without either the tests fail rather than
//! skip: a skipped check would prove nothing. Nothing here talks to a cluster (`helm template` and
//! `helm lint` render locally).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root: the parent of this crate's directory (`tests/`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

fn chart_dir() -> PathBuf {
    repo_root().join("deploy/helm/floodgate")
}

/// The `helm` binary: `$FLOODGATE_HELM`, else `helm` found on the `PATH`. Panics when neither exists.
fn helm() -> PathBuf {
    if let Some(path) = std::env::var_os("FLOODGATE_HELM").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "FLOODGATE_HELM is {}, which is not a file; point it at a helm v3 binary",
            path.display()
        );
        return path;
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("helm");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    panic!(
        "no helm binary: set FLOODGATE_HELM to a helm v3 binary or put `helm` on the PATH \
         (scripts/test installs one); the chart tests do not skip"
    );
}

/// Runs helm with `args` from the repository root.
fn run_helm(args: &[&str]) -> Output {
    let helm = helm();
    Command::new(&helm)
        .args(args)
        .current_dir(repo_root())
        .output()
        .unwrap_or_else(|e| panic!("run {} {args:?}: {e}", helm.display()))
}

fn describe(args: &[&str], out: &Output) -> String {
    format!(
        "helm {args:?} exited with {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs helm and returns its stdout, panicking (with its output) when it fails.
fn helm_ok(args: &[&str]) -> String {
    let out = run_helm(args);
    assert!(out.status.success(), "{}", describe(args, &out));
    String::from_utf8(out.stdout).expect("helm writes UTF-8")
}

/// The documents of a YAML stream (`helm template`'s output), split on `---` lines; empty
/// documents (only comments) are left out.
fn documents(text: &str) -> Vec<yaml_serde::Value> {
    let mut chunks = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" {
            chunks.push(String::new());
        } else {
            let last = chunks.last_mut().expect("at least one chunk");
            last.push_str(line);
            last.push('\n');
        }
    }
    chunks
        .iter()
        .map(|chunk| {
            yaml_serde::from_str::<yaml_serde::Value>(chunk)
                .unwrap_or_else(|e| panic!("a rendered document is not YAML: {e}\n{chunk}"))
        })
        .filter(|doc| !doc.is_null())
        .collect()
}

/// Renders the chart as release `t`, with `extra` arguments (values files, `--set`).
fn render(extra: &[&str]) -> Vec<yaml_serde::Value> {
    let chart = chart_dir();
    let chart = chart.to_str().expect("a UTF-8 path");
    let mut args = vec!["template", "t", chart];
    args.extend_from_slice(extra);
    let docs = documents(&helm_ok(&args));
    assert!(!docs.is_empty(), "helm {args:?} rendered nothing");
    docs
}

fn production_values() -> String {
    let path = chart_dir().join("ci/production-values.yaml");
    assert!(path.is_file(), "{} is missing", path.display());
    path.to_str().expect("a UTF-8 path").to_string()
}

/// `value[a][b]…` for string keys and sequence indexes given as numbers.
fn at<'a>(value: &'a yaml_serde::Value, path: &[&str]) -> &'a yaml_serde::Value {
    let mut v = value;
    for key in path {
        v = match key.parse::<usize>() {
            Ok(i) if v.is_sequence() => &v[i],
            _ => &v[*key],
        };
    }
    v
}

fn str_at<'a>(value: &'a yaml_serde::Value, path: &[&str]) -> &'a str {
    at(value, path).as_str().unwrap_or("")
}

fn seq_at<'a>(value: &'a yaml_serde::Value, path: &[&str]) -> &'a [yaml_serde::Value] {
    at(value, path).as_sequence().map(Vec::as_slice).unwrap_or(&[])
}

fn of_kind<'a>(docs: &'a [yaml_serde::Value], kind: &str) -> Vec<&'a yaml_serde::Value> {
    docs.iter().filter(|d| str_at(d, &["kind"]) == kind).collect()
}

fn the_one<'a>(docs: &'a [yaml_serde::Value], kind: &str) -> &'a yaml_serde::Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

fn component(doc: &yaml_serde::Value) -> &str {
    str_at(doc, &["metadata", "labels", "app.kubernetes.io/component"])
}

/// The agent's container of the DaemonSet.
fn agent_container(daemonset: &yaml_serde::Value) -> &yaml_serde::Value {
    seq_at(daemonset, &["spec", "template", "spec", "containers"])
        .iter()
        .find(|c| str_at(c, &["name"]) == "agent")
        .expect("the DaemonSet has a container named agent")
}

fn agent_toml(docs: &[yaml_serde::Value]) -> String {
    let configmap = the_one(docs, "ConfigMap");
    str_at(configmap, &["data", "agent.toml"]).to_string()
}

/// The lines `key = …` of a TOML text, by key.
fn toml_value<'a>(toml: &'a str, key: &str) -> Option<&'a str> {
    toml.lines().find_map(|line| {
        let (k, v) = line.split_once('=')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// The volume named `name` of a pod template.
fn volume<'a>(workload: &'a yaml_serde::Value, name: &str) -> Option<&'a yaml_serde::Value> {
    seq_at(workload, &["spec", "template", "spec", "volumes"])
        .iter()
        .find(|v| str_at(v, &["name"]) == name)
}

fn mounts(container: &yaml_serde::Value) -> Vec<(&str, &str)> {
    seq_at(container, &["volumeMounts"])
        .iter()
        .map(|m| (str_at(m, &["name"]), str_at(m, &["mountPath"])))
        .collect()
}

fn env_secret<'a>(container: &'a yaml_serde::Value, name: &str) -> Option<(&'a str, &'a str)> {
    seq_at(container, &["env"])
        .iter()
        .find(|e| str_at(e, &["name"]) == name)
        .map(|e| {
            (
                str_at(e, &["valueFrom", "secretKeyRef", "name"]),
                str_at(e, &["valueFrom", "secretKeyRef", "key"]),
            )
        })
}

/// What both renders must have: the agent DaemonSet with its config file and host directories,
/// the ConfigMap naming `redis_url`, the rules service and both disruption budgets.
fn check_common(docs: &[yaml_serde::Value], redis_url: &str) {
    let daemonset = the_one(docs, "DaemonSet");
    let agent = agent_container(daemonset);
    let args: Vec<&str> = seq_at(agent, &["args"])
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let config_at = args.iter().position(|a| *a == "--config");
    assert!(
        config_at.is_some_and(|i| args.get(i + 1) == Some(&"/etc/floodgate/agent.toml")),
        "the agent's args pass --config /etc/floodgate/agent.toml: {args:?}"
    );
    assert!(
        mounts(agent).contains(&("config", "/etc/floodgate/agent.toml")),
        "the config file is mounted where --config points: {:?}",
        mounts(agent)
    );
    let socket = volume(daemonset, "socket-dir").expect("a socket-dir volume");
    assert_eq!(
        str_at(socket, &["hostPath", "path"]),
        "/run/floodgate",
        "the socket directory is the node's /run/floodgate: {socket:?}"
    );
    assert!(
        mounts(agent).contains(&("socket-dir", "/run/floodgate")),
        "the agent mounts the host socket directory at /run/floodgate"
    );
    let state = volume(daemonset, "state-dir").expect("a state-dir volume");
    assert!(
        at(state, &["hostPath"]).is_mapping(),
        "the state directory is on the node"
    );
    let init = seq_at(daemonset, &["spec", "template", "spec", "initContainers"]);
    assert!(
        init.iter().any(|c| str_at(c, &["name"]) == "own-host-dirs"),
        "the init container gives the host directories to uid 10001"
    );
    assert_eq!(str_at(agent, &["readinessProbe", "httpGet", "path"]), "/readyz");
    assert_eq!(str_at(agent, &["livenessProbe", "httpGet", "path"]), "/healthz");
    assert!(
        seq_at(agent, &["ports"])
            .iter()
            .any(|p| at(p, &["containerPort"]).as_u64() == Some(9790)),
        "the admin port 9790 is declared"
    );
    assert!(
        env_secret(agent, "FLOODGATE_RULES_TOKEN").is_some_and(|(name, _)| !name.is_empty()),
        "the rules token comes from a Secret"
    );

    let toml = agent_toml(docs);
    assert_eq!(
        toml_value(&toml, "redis"),
        Some(format!("\"{redis_url}\"").as_str()),
        "agent.toml names the values' Redis URL:\n{toml}"
    );
    assert!(
        toml_value(&toml, "rules_url").is_some(),
        "agent.toml follows the chart's rules service:\n{toml}"
    );

    let pdbs = of_kind(docs, "PodDisruptionBudget");
    let agent_pdb = pdbs
        .iter()
        .find(|p| component(p) == "agent")
        .expect("a PodDisruptionBudget for the agents");
    assert_eq!(at(agent_pdb, &["spec", "maxUnavailable"]).as_u64(), Some(1));
    let rules_pdb = pdbs
        .iter()
        .find(|p| component(p) == "rules")
        .expect("a PodDisruptionBudget for the rules service");
    assert!(at(rules_pdb, &["spec", "minAvailable"]).as_u64().is_some());

    let rules = the_one(docs, "Deployment");
    let container = &seq_at(rules, &["spec", "template", "spec", "containers"])[0];
    assert!(
        env_secret(container, "FLOODGATE_RULES_DB").is_some_and(|(name, _)| !name.is_empty()),
        "the rules store's URL comes from a Secret"
    );
    assert!(
        env_secret(container, "FLOODGATE_RULES_TOKENS").is_some_and(|(name, _)| !name.is_empty()),
        "the rules tokens come from a Secret"
    );
    assert!(
        at(container, &["readinessProbe", "tcpSocket"]).is_mapping(),
        "the rules service is ready when its port accepts"
    );
    let service = the_one(docs, "Service");
    assert!(
        seq_at(service, &["spec", "ports"])
            .iter()
            .any(|p| at(p, &["port"]).as_u64() == Some(9791)),
        "the rules Service serves 9791"
    );
    assert!(
        of_kind(docs, "Secret").is_empty(),
        "the chart creates no Secret: secrets come from existing ones"
    );
}

#[test]
fn the_chart_lints() {
    let chart = chart_dir();
    let chart = chart.to_str().expect("a UTF-8 path");
    helm_ok(&["lint", "--strict", chart]);
    let production = production_values();
    helm_ok(&["lint", "--strict", chart, "-f", production.as_str()]);
}

#[test]
fn the_defaults_render_an_agent_daemonset_and_a_rules_service() {
    let docs = render(&[]);
    let values: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).expect("read values.yaml"),
    )
    .expect("values.yaml is YAML");
    let redis_url = str_at(&values, &["redis", "url"]);
    assert!(!redis_url.is_empty(), "values.yaml sets redis.url");
    check_common(&docs, redis_url);

    let agent = agent_container(the_one(&docs, "DaemonSet"));
    let toml = agent_toml(&docs);
    for key in ["redis_ca", "redis_password_file", "grpc", "listen_tcp"] {
        assert!(
            toml_value(&toml, key).is_none(),
            "the defaults set no {key}:\n{toml}"
        );
    }
    assert!(
        !seq_at(agent, &["ports"])
            .iter()
            .any(|p| str_at(p, &["name"]) == "grpc"),
        "no gRPC port by default"
    );
}

#[test]
fn the_production_values_mount_the_redis_secrets_and_serve_grpc() {
    let production = production_values();
    let docs = render(&["-f", production.as_str()]);
    let values: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(&production).expect("read the production values"))
            .expect("the production values are YAML");
    let redis_url = str_at(&values, &["redis", "url"]);
    assert!(redis_url.starts_with("rediss://"), "production uses TLS to Redis");
    check_common(&docs, redis_url);

    let daemonset = the_one(&docs, "DaemonSet");
    let agent = agent_container(daemonset);
    let toml = agent_toml(&docs);
    let ca_secret = str_at(&values, &["redis", "tls", "caSecret"]);
    let password_secret = str_at(&values, &["redis", "passwordSecret", "name"]);
    assert!(!ca_secret.is_empty() && !password_secret.is_empty());

    let ca = volume(daemonset, "redis-ca").expect("a redis-ca volume");
    assert_eq!(str_at(ca, &["secret", "secretName"]), ca_secret);
    let password = volume(daemonset, "redis-password").expect("a redis-password volume");
    assert_eq!(str_at(password, &["secret", "secretName"]), password_secret);
    let mounted = mounts(agent);
    for (name, key) in [
        ("redis-ca", "redis_ca"),
        ("redis-password", "redis_password_file"),
    ] {
        let (_, dir) = mounted
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("the agent mounts {name}: {mounted:?}"));
        let file = toml_value(&toml, key)
            .unwrap_or_else(|| panic!("agent.toml has {key}:\n{toml}"))
            .trim_matches('"');
        assert!(
            file.starts_with(&format!("{dir}/")),
            "{key} = {file} is inside the {name} mount at {dir}"
        );
    }
    assert_eq!(toml_value(&toml, "redis_cluster"), Some("true"));

    let grpc = seq_at(agent, &["ports"])
        .iter()
        .find(|p| str_at(p, &["name"]) == "grpc")
        .expect("the agent declares a grpc port");
    let port = at(grpc, &["containerPort"]).as_u64().expect("a numeric port");
    assert_eq!(
        toml_value(&toml, "grpc"),
        Some(format!("\"0.0.0.0:{port}\"").as_str()),
        "agent.toml serves gRPC on the declared port:\n{toml}"
    );

    // The rules service over TLS, and the agents following it over https.
    let rules = the_one(&docs, "Deployment");
    let container = &seq_at(rules, &["spec", "template", "spec", "containers"])[0];
    let env_names: Vec<&str> = seq_at(container, &["env"])
        .iter()
        .map(|e| str_at(e, &["name"]))
        .collect();
    assert!(
        env_names.contains(&"FLOODGATE_RULES_TLS_CERT") && env_names.contains(&"FLOODGATE_RULES_TLS_KEY"),
        "the rules service gets its certificate and key: {env_names:?}"
    );
    let tls = volume(rules, "tls").expect("a tls volume on the rules service");
    assert_eq!(
        str_at(tls, &["secret", "secretName"]),
        str_at(&values, &["rules", "tls", "secretName"])
    );
    assert!(
        toml_value(&toml, "rules_url").is_some_and(|u| u.starts_with("\"https://")),
        "the agents follow the rules service over https:\n{toml}"
    );
}

#[test]
fn a_bad_value_fails_the_schema() {
    let chart = chart_dir();
    let chart = chart.to_str().expect("a UTF-8 path");
    for (set, word) in [
        ("redis.url=http://x", "redis"),
        ("agent.logFormat=xml", "logFormat"),
        ("image.repository=", "repository"),
    ] {
        let args = ["template", "t", chart, "--set", set];
        let out = run_helm(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "--set {set} was accepted\n{}",
            describe(&args, &out)
        );
        assert!(
            stderr.contains("schema") && stderr.contains(word),
            "--set {set} failed for another reason than the schema\n{}",
            describe(&args, &out)
        );
    }
}

#[test]
fn every_compose_service_has_a_healthcheck() {
    let path = repo_root().join("deploy/compose/compose.yaml");
    let text = std::fs::read_to_string(&path).expect("read compose.yaml");
    let mut compose: yaml_serde::Value = yaml_serde::from_str(&text).expect("compose.yaml is YAML");
    // The redis nodes take theirs from an anchor merged with `<<`.
    compose.apply_merge().expect("the merge keys resolve");
    let services = at(&compose, &["services"])
        .as_mapping()
        .expect("compose.yaml has services");
    assert!(!services.is_empty());
    let mut missing = Vec::new();
    for (name, service) in services {
        let name = name.as_str().unwrap_or("?");
        let test = at(service, &["healthcheck", "test"]);
        let ok = match test {
            yaml_serde::Value::Sequence(items) => items.len() > 1,
            yaml_serde::Value::String(s) => !s.trim().is_empty(),
            _ => false,
        };
        if !ok {
            missing.push(name.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "services without a healthcheck test: {missing:?}"
    );
}
