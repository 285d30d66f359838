//! Operator commands against a real agent: `floodgate check` (exit codes 0/1/2, text and JSON),
//! `floodgate status`, completions, the man page, JSON logs, and a closed pipe (the command ends by
//! SIGPIPE; the daemons ignore it).

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};

use floodgate_tests::{floodgate_bin, Agent, RedisServer};

const RULES: &str = r#"{"rules":[
  {"id":"one","dimension":"user","limit":1,"windowSeconds":60},
  {"id":"api","dimension":"user","match":{"endpoint":"/api/*"},"limit":5,"windowSeconds":60}]}"#;

fn floodgate(args: &[&str]) -> Output {
    Command::new(floodgate_bin())
        .args(args)
        .output()
        .expect("run floodgate")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A one-minute window: the checks take milliseconds of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_prints_the_decision_and_exits_by_it() {
    let agent = Agent::builder().rules(RULES).start().await;
    let socket = agent.socket().to_str().unwrap().to_string();
    let first = floodgate(&["check", "user:1", "one", "--socket", &socket]);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    assert!(
        text(&first.stdout).starts_with("allowed: limit 1 remaining 0"),
        "{}",
        text(&first.stdout)
    );
    let second = floodgate(&["check", "user:1", "one", "--socket", &socket, "--json"]);
    assert_eq!(second.status.code(), Some(1), "denied exits 1");
    let d: serde_json::Value = serde_json::from_slice(&second.stdout).unwrap();
    assert_eq!(d["allowed"], false);
    assert!(d["retryAfterMs"].as_u64().unwrap() >= 1);
    assert_eq!(d["items"][0]["ruleId"], "one");
    // An attribute check: the agent picks the rules that match.
    let attrs = floodgate(&[
        "check",
        "--endpoint",
        "/api/x",
        "--user",
        "7",
        "--socket",
        &socket,
        "--json",
    ]);
    assert_eq!(attrs.status.code(), Some(0), "{}", text(&attrs.stderr));
    let d: serde_json::Value = serde_json::from_slice(&attrs.stdout).unwrap();
    let rules: Vec<&str> = d["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["ruleId"].as_str().unwrap())
        .collect();
    assert_eq!(rules, ["one", "api"]);
    assert_eq!(d["items"][1]["remaining"], 4, "1 of 5 taken");
    // No agent: exit 2, and it says nothing was decided.
    let gone = floodgate(&[
        "check",
        "user:1",
        "one",
        "--socket",
        "/nonexistent/floodgate.sock",
        "--timeout-ms",
        "200",
    ]);
    assert_eq!(gone.status.code(), Some(2));
    assert!(
        text(&gone.stderr).contains("did not answer"),
        "{}",
        text(&gone.stderr)
    );
    // An unknown rule: the agent refuses; exit 2 with its reason.
    let unknown = floodgate(&["check", "user:1", "nope", "--socket", &socket]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(
        text(&unknown.stderr).contains("nope"),
        "{}",
        text(&unknown.stderr)
    );
    // Neither KEY RULE nor attributes: a usage error.
    assert_ne!(floodgate(&["check", "--socket", &socket]).status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reads_the_agent_in_text_and_json() {
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .rules(RULES)
        .redis(&redis.url())
        .arg("--agents")
        .arg("3")
        .start()
        .await;
    let admin = agent.admin_addr().await.to_string();
    let out = floodgate(&["status", "--admin", &admin]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t = text(&out.stdout);
    assert!(t.contains("rules         2 (version 0)"), "{t}");
    assert!(t.contains("breakers      0:closed"), "{t}");
    assert!(t.contains("fallback      inactive"), "{t}");
    assert!(t.contains("live agents   3"), "{t}");
    let out = floodgate(&["status", "--admin", &admin, "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["status"]["liveAgents"], 3);
    assert_eq!(j["batch"]["rules"].as_array().unwrap().len(), 2);
    // No agent there: exit 1 with the reason.
    let port = floodgate_tests::free_port();
    let out = floodgate(&["status", "--admin", &format!("127.0.0.1:{port}")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot reach"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn completions_and_man_page_cover_the_commands() {
    let bash = floodgate(&["completions", "bash"]);
    assert!(bash.status.success());
    let b = text(&bash.stdout);
    for word in ["import-envoy", "status", "--listen-tcp", "--grpc"] {
        assert!(b.contains(word), "bash completion lacks {word}");
    }
    let man = floodgate(&["man"]);
    assert!(man.status.success());
    let m = text(&man.stdout);
    assert!(
        m.contains(".TH floodgate 1") && m.contains("rules\\-server"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_per_line() {
    let mut agent = Agent::builder()
        .rules(RULES)
        .arg("--log-format")
        .arg("json")
        .spawn();
    let log = floodgate_tests::eventually(
        "the agent logs its rules",
        std::time::Duration::from_secs(10),
        || {
            let log = agent.log();
            async move { log.contains("rules loaded").then_some(log) }
        },
    )
    .await;
    for line in log.lines().filter(|l| !l.is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string() && v["message"].is_string(), "{line}");
    }
    assert!(log.lines().any(|l| l.contains("\"count\":2")), "{log}");
    agent.terminate().await;
}

fn write_rules(path: &std::path::Path, limit: u64) {
    let text = format!(r#"{{"rules":[{{"id":"r","dimension":"user","limit":{limit},"windowSeconds":60}}]}}"#);
    std::fs::write(path, text).unwrap();
}

/// `--config`: the file's keys are the flags' defaults. SIGHUP reads it again: the flush interval
/// and the rules file change at run time, other changes are reported as needing a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_file_is_read_and_sighup_reloads_what_it_can() {
    let dir = tempfile::tempdir().unwrap();
    let (rules, config) = (dir.path().join("rules.json"), dir.path().join("floodgate.toml"));
    write_rules(&rules, 1);
    let toml = |flush: u64, timeout: u64| {
        format!(
            "rules = {:?}\nflush_interval_ms = {flush}\nredis_timeout_ms = {timeout}\nrules_listen = \"off\"\n",
            rules.display().to_string()
        )
    };
    std::fs::write(&config, toml(100, 5)).unwrap();
    let agent = Agent::builder()
        .arg("--config")
        .arg(config.to_str().unwrap())
        .start()
        .await;
    let client = floodgate_tests::patient_client(agent.socket()).await;
    assert!(client.allow("user:1", "r", 1).await.unwrap().allowed);
    let d = client.allow("user:1", "r", 1).await.unwrap();
    assert!(!d.allowed && d.limit == 1, "the file's rules apply: {d:?}");
    let admin = agent.admin_addr().await;
    let (_, batch) = floodgate_tests::http_get(admin, "/v1/batch").await;
    assert!(batch.contains("\"defaultFlushIntervalMs\":100"), "{batch}");

    write_rules(&rules, 5);
    std::fs::write(&config, toml(50, 9)).unwrap();
    floodgate_tests::signal(agent.pid().unwrap(), 1);
    floodgate_tests::eventually(
        "the reload is applied",
        std::time::Duration::from_secs(10),
        || async {
            let (_, batch) = floodgate_tests::http_get(admin, "/v1/batch").await;
            batch.contains("\"defaultFlushIntervalMs\":50").then_some(())
        },
    )
    .await;
    let d = client.allow("user:2", "r", 1).await.unwrap();
    assert_eq!((d.allowed, d.limit), (true, 5), "the rules file was read again");
    let log = agent.log();
    assert!(
        log.lines()
            .any(|l| l.contains("only after a restart") && l.contains("redis_timeout_ms")),
        "{log}"
    );
    // A broken file on reload changes nothing and says so.
    std::fs::write(&config, "flush_interval_ms = \"soon\"\n").unwrap();
    floodgate_tests::signal(agent.pid().unwrap(), 1);
    floodgate_tests::eventually(
        "the refusal is logged",
        std::time::Duration::from_secs(10),
        || async { agent.log().contains("reload (SIGHUP) refused").then_some(()) },
    )
    .await;
    let (_, batch) = floodgate_tests::http_get(admin, "/v1/batch").await;
    assert!(batch.contains("\"defaultFlushIntervalMs\":50"), "{batch}");
    // A bad key at start: the agent does not start, and names it.
    std::fs::write(&config, "sockett = \"/x\"\n").unwrap();
    let out = floodgate(&["agent", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("unknown key \"sockett\""),
        "{}",
        text(&out.stderr)
    );
}

/// Values the agent cannot run with are refused as the command line (or config file) is parsed,
/// with the flag and its range named, never clamped into something else.
#[test]
fn out_of_range_settings_are_refused_at_parse_time() {
    for (flag, value, range) in [
        ("--redis-timeout-ms", "0", "1.."),
        ("--breaker-failures", "0", "1.."),
        ("--heartbeat-ms", "9", "10.."),
        ("--flush-interval-ms", "0", "1.."),
        ("--rules-poll-ms", "99", "100.."),
        ("--rules-watch-s", "56", "0..=55"),
    ] {
        let out = floodgate(&["agent", flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let err = text(&out.stderr);
        assert!(err.contains(flag) && err.contains(range), "{flag} {value}: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("floodgate.toml");
    std::fs::write(&config, "heartbeat_ms = 5\n").unwrap();
    let out = floodgate(&["agent", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--heartbeat-ms"),
        "{}",
        text(&out.stderr)
    );
    let out = floodgate(&["check", "k", "r", "--timeout-ms", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// A pipe whose reader is gone: the write end of `true`'s stdin, once `true` has exited. Anything
/// written to it gets EPIPE, or SIGPIPE where that is not ignored, as `floodgate … | head -1` gets
/// once head has its line; no race, since the reader is gone before the writer starts.
fn pipe_without_reader() -> Stdio {
    let mut reader = Command::new("true")
        .stdin(Stdio::piped())
        .spawn()
        .expect("run true");
    let write_end = reader.stdin.take().expect("true's stdin");
    assert!(reader.wait().expect("true exits").success());
    Stdio::from(write_end)
}

/// Every printing command ends like a Unix tool when its reader goes away (`floodgate status | head
/// -1`): killed by SIGPIPE, with nothing on stderr. Before, Rust's ignored SIGPIPE made the first
/// `println!` panic: "failed printing to stdout: Broken pipe", exit 101.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_printing_command_ends_quietly_when_its_reader_goes_away() {
    // The embedded default: an admin API for status, a rules API for rules list.
    let agent = Agent::builder().start().await;
    let admin = agent.admin_addr().await.to_string();
    let rules = format!("http://{}", agent.rules_addr().await);
    let socket = agent.socket().to_str().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.json");
    std::fs::write(&file, RULES).unwrap();
    let file = file.to_str().unwrap();
    for args in [
        vec!["status", "--admin", &admin],
        vec!["status", "--admin", &admin, "--json"],
        vec!["rules", "--server", &rules, "list"],
        vec!["rules", "--server", &rules, "get", "api-per-user"],
        vec!["rules", "validate", file],
        vec!["check", "user:1", "api-per-user", "--socket", &socket],
        vec!["completions", "bash"],
    ] {
        let out = Command::new(floodgate_bin())
            .args(&args)
            .stdout(pipe_without_reader())
            .output()
            .expect("run floodgate");
        let stderr = text(&out.stderr);
        assert!(
            !stderr.contains("panicked") && !stderr.contains("failed printing"),
            "{args:?}: {stderr}"
        );
        assert_ne!(out.status.code(), Some(101), "{args:?}: a panic's exit code");
        assert_eq!(
            out.status.signal(),
            Some(13),
            "{args:?} ends by SIGPIPE, as `yes | head -1` does: {:?} {stderr}",
            out.status
        );
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

/// The daemons keep SIGPIPE ignored: an agent and a rules server whose stderr (their log) is a pipe
/// with no reader keep serving, each log line's EPIPE dropped, where SIGPIPE would kill them at their
/// first line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemons_outlive_a_log_pipe_without_reader() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("a.sock");
    let rules_file = dir.path().join("rules.json");
    std::fs::write(&rules_file, RULES).unwrap();
    let mut agent = Command::new(floodgate_bin())
        .args(["agent", "--admin", "off", "--rules-listen", "off", "--socket"])
        .arg(&socket)
        .arg("--rules")
        .arg(&rules_file)
        .env("STATE_DIRECTORY", dir.path())
        .stdout(Stdio::null())
        .stderr(pipe_without_reader())
        .spawn()
        .expect("spawn the agent");
    let port = floodgate_tests::free_port();
    let listen = format!("127.0.0.1:{port}");
    let db = format!("sqlite://{}", dir.path().join("r.db").display());
    let mut server = Command::new(floodgate_bin())
        .args(["rules-server", "--listen", &listen, "--db", &db])
        .stdout(Stdio::null())
        .stderr(pipe_without_reader())
        .spawn()
        .expect("spawn the rules server");

    floodgate_tests::eventually("the agent listens", std::time::Duration::from_secs(10), || {
        let socket = socket.clone();
        async move { tokio::net::UnixStream::connect(&socket).await.ok() }
    })
    .await;
    let client = floodgate_tests::patient_client(&socket).await;
    let d = client.allow("user:1", "one", 1).await.unwrap();
    assert!(d.allowed && d.from_agent_answer(), "{d:?}");
    floodgate_tests::eventually(
        "the rules server answers",
        std::time::Duration::from_secs(10),
        || {
            let listen = listen.clone();
            async move { std::net::TcpStream::connect(&listen).ok() }
        },
    )
    .await;
    assert_eq!(
        floodgate_tests::http_get(listen.parse().unwrap(), "/v1/rules")
            .await
            .0,
        200
    );
    for (name, child) in [("agent", &mut agent), ("rules server", &mut server)] {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the {name} died: {:?}",
            child.try_wait()
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// `floodgate agent --help` groups its ~55 flags under headings and ends with examples, each of
/// whose flags the agent accepts (checked by parsing it with `--help` at its end: an unknown flag
/// fails before the help is printed).
#[test]
fn the_agents_help_is_grouped_and_its_examples_parse() {
    let out = Command::new(floodgate_bin())
        .args(["agent", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for heading in [
        "Listeners:",
        "Envoy gRPC:",
        "Connections:",
        "Redis:",
        "Execution modes:",
        "When Redis is slow or away:",
        "Rules:",
        "Observability:",
        "Traces:",
        "Examples:",
    ] {
        assert!(help.lines().any(|l| l == heading), "no {heading:?} in:\n{help}");
    }
    let examples: Vec<&str> = help
        .lines()
        .skip_while(|l| *l != "Examples:")
        .filter_map(|l| l.strip_prefix("  floodgate "))
        .collect();
    assert_eq!(examples.len(), 4, "{help}");
    for example in examples {
        // The config file is read before the flags: the one the .deb installs there.
        let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/debian/agent.toml");
        let mut args: Vec<&str> = example
            .split_whitespace()
            .map(|a| {
                if a == "/etc/floodgate/agent.toml" {
                    shipped
                } else {
                    a
                }
            })
            .collect();
        args.push("--help");
        let out = Command::new(floodgate_bin()).args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "floodgate {example}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
