//! The deployment files under `deploy/`, checked offline: every YAML and JSON file parses (all the
//! documents of a multi-document YAML file), the systemd unit and the Containerfile are well formed,
//! every `FLOODGATE_*` variable they name is one the binary reads, and every metric the Grafana
//! dashboard queries is one a real agent exports on `/metrics`.
//!
//! Nothing here starts Docker, Kubernetes, Prometheus or Grafana, so what only they would catch is
//! not checked: that the image builds, that compose and the API server accept the manifests' fields,
//! that the PromQL parses, that Grafana draws the panels. The metrics test starts a real
//! `redis-server` and agent, as the other integration tests do.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use floodgate_tests::{eventually, http_get, patient_client, Agent, RedisServer};

/// The repository root: the parent of this crate's directory (`tests/`).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

/// Every file under `dir`, recursively, sorted so that failures come in a stable order.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries = std::fs::read_dir(&d).unwrap_or_else(|e| panic!("read {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn extension(path: &Path) -> &str {
    path.extension().and_then(|e| e.to_str()).unwrap_or("")
}

/// Every document of a YAML stream.
fn yaml_documents(text: &str) -> Result<Vec<yaml_serde::Value>, yaml_serde::Error> {
    yaml_serde::Deserializer::from_str(text)
        // This is `Value::deserialize(document)`, spelled through a function of yaml_serde's because
        // this crate does not depend on serde, whose `Deserialize` trait that call needs.
        // `singleton_map` only changes how enums are read, and a `Value` has none.
        .map(yaml_serde::with::singleton_map::deserialize::<yaml_serde::Value, _>)
        .collect()
}

/// The lines of a file with `\` continuations joined and comment lines dropped (a comment inside a
/// continued Containerfile instruction is dropped too, as Docker does), numbered from 1 by the line
/// each one starts on.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut lines = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (pending.is_none() && trimmed.is_empty()) {
            continue;
        }
        let (start, mut line) = pending.take().unwrap_or((i + 1, String::new()));
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                line.push_str(head);
                line.push(' ');
                pending = Some((start, line));
            }
            None => {
                line.push_str(trimmed);
                lines.push((start, line));
            }
        }
    }
    if let Some(last) = pending {
        lines.push(last);
    }
    lines
}

/// What is wrong with a systemd unit: lines that are neither `[Section]` nor `Key=Value`, keys
/// outside a section, missing sections, no `ExecStart=` in `[Service]`.
fn systemd_unit_problems(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut sections = BTreeSet::new();
    let mut section: Option<&str> = None;
    let mut exec_start = false;
    for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            sections.insert(name);
            section = Some(name);
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            problems.push(format!("line {n} is neither [Section] nor Key=Value: {line}"));
            continue;
        };
        let key = key.trim();
        if key.is_empty()
            || !key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            problems.push(format!("line {n} has a bad key {key:?}"));
        }
        match section {
            None => problems.push(format!("line {n} comes before any [Section]: {line}")),
            Some("Service") if key == "ExecStart" => exec_start = !value.trim().is_empty(),
            Some(_) => {}
        }
    }
    for wanted in ["Unit", "Service", "Install"] {
        if !sections.contains(wanted) {
            problems.push(format!("no [{wanted}] section"));
        }
    }
    if !exec_start {
        problems.push("no ExecStart= in [Service]".into());
    }
    problems
}

/// Every Dockerfile instruction (the Containerfile is the same format).
const INSTRUCTIONS: &[&str] = &[
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "MAINTAINER",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
];

/// What is wrong with a Containerfile: instructions nobody knows, a first instruction other than
/// FROM (or the ARGs FROM may use). Heredocs (`RUN <<EOF`) are not understood; ours has none.
fn containerfile_problems(text: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let lines = logical_lines(text);
    for (n, line) in &lines {
        let word = line.split_whitespace().next().unwrap_or("");
        if !INSTRUCTIONS.contains(&word.to_ascii_uppercase().as_str()) {
            problems.push(format!("line {n} starts with no known instruction: {line}"));
        }
    }
    let first = lines
        .iter()
        .map(|(_, l)| l.split_whitespace().next().unwrap_or("").to_ascii_uppercase())
        .find(|w| w != "ARG");
    if first.as_deref() != Some("FROM") {
        problems.push(format!(
            "the first instruction (after ARGs) is {first:?}, not FROM"
        ));
    }
    problems
}

#[test]
fn the_deploy_files_parse() {
    let deploy = repo_root().join("deploy");
    let mut problems = Vec::new();
    let (mut yaml, mut json, mut units, mut containerfiles) = (0, 0, 0, 0);
    for path in files_under(&deploy) {
        let name = path.strip_prefix(&deploy).unwrap_or(&path).display().to_string();
        // Helm templates are Go templates, not YAML: tests/tests/helm_chart.rs renders them.
        if name.starts_with("helm/") && name.contains("/templates/") {
            continue;
        }
        let text = read(&path);
        match extension(&path) {
            "yaml" | "yml" => {
                yaml += 1;
                match yaml_documents(&text) {
                    Ok(docs) if docs.is_empty() => problems.push(format!("{name}: no YAML document")),
                    Ok(_) => {}
                    Err(e) => problems.push(format!("{name}: {e}")),
                }
            }
            "json" => {
                json += 1;
                if let Err(e) = serde_json::from_str::<serde_json::Value>(&text) {
                    problems.push(format!("{name}: {e}"));
                }
            }
            "service" => {
                units += 1;
                problems.extend(
                    systemd_unit_problems(&text)
                        .into_iter()
                        .map(|p| format!("{name}: {p}")),
                );
            }
            _ if path
                .file_name()
                .is_some_and(|f| f == "Containerfile" || f == "Dockerfile") =>
            {
                containerfiles += 1;
                problems.extend(
                    containerfile_problems(&text)
                        .into_iter()
                        .map(|p| format!("{name}: {p}")),
                );
            }
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "deploy/ has problems:\n{}",
        problems.join("\n")
    );
    // A file that moved or was renamed would otherwise pass unchecked.
    assert!(
        yaml >= 5,
        "expected the compose, Kubernetes, Prometheus and Grafana YAML files, found {yaml}"
    );
    assert!(json >= 1, "expected the Grafana dashboard");
    assert!(units >= 1, "expected the systemd unit");
    assert!(containerfiles >= 1, "expected the Containerfile");
}

/// The image carries the licence (Apache-2.0 asks for a copy with every redistribution): its last
/// stage copies LICENSE and the Debian copyright file, which exist, and labels the licence.
#[test]
fn the_image_carries_the_licence() {
    let text = read(&repo_root().join("deploy/container/Containerfile"));
    let last_stage = text.rsplit("\nFROM ").next().unwrap();
    assert!(
        last_stage
            .lines()
            .any(|l| l == "COPY LICENSE deploy/debian/copyright /usr/share/doc/floodgate/"),
        "{last_stage}"
    );
    assert!(
        last_stage
            .lines()
            .any(|l| l == "LABEL org.opencontainers.image.licenses=\"Apache-2.0\""),
        "{last_stage}"
    );
    for f in ["LICENSE", "deploy/debian/copyright"] {
        assert!(repo_root().join(f).is_file(), "{f}");
    }
}

#[test]
fn the_checkers_catch_broken_files() {
    // The checks above would pass vacuously if they accepted anything.
    assert!(yaml_documents("a: 1\n---\nb: [\n").is_err());
    assert_eq!(yaml_documents("a: 1\n---\nb: 2\n").map(|d| d.len()).ok(), Some(2));
    assert!(!systemd_unit_problems("[Unit]\nDescription=x\n[Service]\nUser floodgate\n").is_empty());
    assert!(!containerfile_problems("FROM debian\nRUN true && \\\n  true\nCOPYY a b\n").is_empty());
    assert!(containerfile_problems("# c\nFROM debian\nRUN a \\\n  # inside\n  b\nCMD [\"x\"]\n").is_empty());
}

/// Every `FLOODGATE_…` environment variable a text names (not the bare `FLOODGATE_` of
/// `FLOODGATE_*`).
fn floodgate_variables(text: &str) -> BTreeSet<&str> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("FLOODGATE_") {
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..len].trim_end_matches('_');
        if name.len() > "FLOODGATE".len() {
            names.insert(name);
        }
        rest = &tail[len..];
    }
    names
}

#[test]
fn every_floodgate_variable_in_deploy_is_a_flag() {
    let root = repo_root();
    // The variables the binary reads: every `env = "FLOODGATE_…"` of its clap arguments.
    let mut known = BTreeSet::new();
    for path in files_under(&root.join("agent/src")) {
        if extension(&path) != "rs" {
            continue;
        }
        for piece in read(&path).split("env = \"").skip(1) {
            if let Some((name, _)) = piece.split_once('"') {
                known.insert(name.to_string());
            }
        }
    }
    assert!(
        known.contains("FLOODGATE_REDIS_CLUSTER"),
        "the flag scan found {known:?}"
    );
    let deploy = root.join("deploy");
    let mut unknown = Vec::new();
    for path in files_under(&deploy) {
        let text = read(&path);
        for name in floodgate_variables(&text) {
            if !known.contains(name) {
                unknown.push(format!(
                    "{} names {name}",
                    path.strip_prefix(&deploy).unwrap_or(&path).display()
                ));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "deploy/ sets variables no flag reads (a typo is silently ignored):\n{}",
        unknown.join("\n")
    );
}

/// Every `expr` string anywhere in a Grafana dashboard (panels, rows' nested panels, targets).
fn exprs<'a>(value: &'a serde_json::Value, out: &mut Vec<&'a str>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                match v {
                    serde_json::Value::String(expr) if key == "expr" => out.push(expr),
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => {
            for v in items {
                exprs(v, out);
            }
        }
        _ => {}
    }
}

/// Every `floodgate_…` metric name a PromQL expression reads.
fn metric_names(expr: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("floodgate_") {
        let joined = rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !joined {
            names.push(&tail[..len]);
        }
        rest = &tail[len..];
    }
    names
}

/// The metric family a series name belongs to, and whether the series is a histogram bucket:
/// `x_bucket`, `x_sum` and `x_count` are series of the histogram (or summary) `x`.
fn family(series: &str) -> (&str, bool) {
    if let Some(base) = series.strip_suffix("_bucket") {
        return (base, true);
    }
    let base = series
        .strip_suffix("_sum")
        .or_else(|| series.strip_suffix("_count"));
    (base.unwrap_or(series), false)
}

/// Whether a Prometheus text exposition has the family `name`: a sample line of it, or its
/// `# TYPE` line (a labelled family may have no series yet). A family the dashboard reads buckets
/// of must be a histogram: a summary has no `_bucket` series, and its panel would stay empty.
fn exports(exposition: &str, name: &str, histogram: bool) -> bool {
    exposition.lines().any(|line| {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut words = declared.split_whitespace();
            return words.next() == Some(name) && (!histogram || words.next() == Some("histogram"));
        }
        let sample = if histogram {
            line.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix("_bucket"))
        } else {
            line.strip_prefix(name)
        };
        sample.is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
    })
}

const RULES: &str = r#"
# Limit 2: five checks on one key are two admissions, a rejection from Redis, then cached
# rejections.
[[rules]]
id = "two-a-minute"
dimension = "user"
limit = 2
windowSeconds = 60

# A batched rule, so that the agent flushes: the flush metrics describe flush calls.
[[rules]]
id = "batched-per-user"
dimension = "user"
limit = 1000
windowSeconds = 60
execution = "batched"
"#;

#[tokio::test]
async fn every_dashboard_metric_is_exported() {
    let path = repo_root().join("deploy/grafana/dashboards/floodgate.json");
    let dashboard: serde_json::Value = serde_json::from_str(&read(&path)).expect("the dashboard is JSON");
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    // Family name → whether a panel reads its buckets.
    let mut expected: BTreeMap<String, bool> = BTreeMap::new();
    for expr in &all {
        for series in metric_names(expr) {
            let (name, bucket) = family(series);
            *expected.entry(name.to_string()).or_default() |= bucket;
        }
    }
    assert!(
        !expected.is_empty(),
        "no floodgate_ metric in the dashboard's queries"
    );
    assert!(expected.contains_key("floodgate_checks_total"), "{expected:?}");
    assert_eq!(
        expected.get("floodgate_check_duration_seconds"),
        Some(&true),
        "{expected:?}"
    );

    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient_client(agent.socket()).await;
    let mut rejected = 0;
    for _ in 0..5 {
        let d = client
            .allow("user:deploy", "two-a-minute", 1)
            .await
            .expect("a check");
        rejected += u32::from(!d.allowed);
    }
    assert_eq!(rejected, 3, "limit 2, five checks");
    // A batched key admits one check until its first learn (then its share): one check is enough
    // to give the flusher something to write.
    let d = client
        .allow("user:deploy", "batched-per-user", 1)
        .await
        .expect("a batched check");
    assert!(d.allowed, "{d:?}");

    // Some families appear only after the work they count (a flush, an event sent), so poll. The
    // deadline is ours, shorter than eventually's patience, so that a failure can name what is
    // missing instead of only timing out.
    let admin = agent.admin_addr().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let expected = &expected;
    let (missing, body) = eventually(
        "GET /metrics answers",
        Duration::from_secs(30),
        move || async move {
            let (status, body) = http_get(admin, "/metrics").await;
            let missing: Vec<String> = if status == 200 {
                expected
                    .iter()
                    .filter(|(name, histogram)| !exports(&body, name, **histogram))
                    .map(|(name, histogram)| {
                        if *histogram {
                            format!("{name} (as a histogram: the dashboard reads its _bucket series)")
                        } else {
                            name.clone()
                        }
                    })
                    .collect()
            } else {
                vec![format!("every metric: GET /metrics answered {status}")]
            };
            (missing.is_empty() || Instant::now() >= deadline).then_some((missing, body))
        },
    )
    .await;
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics the agent does not export:\n{}\n\n/metrics:\n{body}",
        missing.join("\n")
    );
}
