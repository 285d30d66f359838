//! Rules as code against a real rules service: `floodgate rules validate` names every problem
//! offline, `diff` says what `apply` would do, `apply` writes only what differs (a second apply
//! writes nothing) and `--prune` deletes what the files lack; TOML, JSON and envoyproxy/ratelimit
//! YAML alike.

use std::path::Path;
use std::process::Command;

use floodgate_tests::{floodgate_bin, RulesServer};

fn floodgate(server: Option<&RulesServer>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(floodgate_bin());
    cmd.arg("rules");
    if let Some(s) = server {
        cmd.args(["--server", &s.url(), "--token", "s3cret"]);
    }
    let out = cmd.args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_diff_apply_and_prune() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let toml = write(
        d,
        "api.toml",
        "[[rules]]\nid = \"api\"\ndimension = \"user\"\nlimit = 100\nwindowSeconds = 60\n\n\
         [[rules]]\nid = \"monthly\"\ndimension = \"api_key\"\nlimit = 1000000\nalgorithm = \"quota\"\nperiod = \"month\"\n",
    );
    let yaml = write(
        d,
        "edge.yaml",
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 30}\n",
    );
    let bad = write(
        d,
        "bad.json",
        r#"{"rules":[{"id":"x","dimension":"user","limit":0,"windowSeconds":60,"colour":"red"}]}"#,
    );
    // Offline: no server involved.
    let (code, out, _) = floodgate(None, &["validate", &toml, &yaml]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 rules valid"), "{out}");
    let (code, _, err) = floodgate(None, &["validate", &toml, &bad]);
    assert_eq!(code, 1);
    assert!(
        err.contains("bad.json: x: limit:") && err.contains("bad.json: x: colour:"),
        "{err}"
    );

    let server = RulesServer::start(&format!("sqlite://{}", d.join("r.db").display()), &["ops:s3cret"]).await;
    let (code, out, err) = floodgate(Some(&server), &["diff", &toml, &yaml]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("+ api") && out.contains("+ monthly") && out.contains("+ edge.remote_address"),
        "{out}"
    );
    let (code, out, err) = floodgate(Some(&server), &["apply", &toml, &yaml]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("3 changes applied"), "{out}");
    // Idempotent: nothing to write the second time.
    let (code, out, _) = floodgate(Some(&server), &["apply", &toml, &yaml]);
    assert_eq!(code, 0);
    assert!(
        out.contains("no changes") && out.contains("0 changes applied"),
        "{out}"
    );
    let (code, _, _) = floodgate(Some(&server), &["diff", "--exit-code", &toml, &yaml]);
    assert_eq!(code, 0, "nothing to change");

    // A changed limit is one change, named by its field; --exit-code says so.
    let toml2 = write(
        d,
        "api.toml",
        "[[rules]]\nid = \"api\"\ndimension = \"user\"\nlimit = 200\nwindowSeconds = 60\n",
    );
    let (code, out, _) = floodgate(Some(&server), &["diff", "--exit-code", &toml2, &yaml]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("~ api (limit)") && out.contains("? monthly"),
        "{out}"
    );
    let (code, out, _) = floodgate(Some(&server), &["apply", &toml2, &yaml]);
    assert_eq!(code, 0);
    assert!(out.contains("1 changes applied"), "{out}");
    let (_, listed, _) = floodgate(Some(&server), &["--json", "get", "api"]);
    assert!(listed.contains("\"limit\":200"), "{listed}");
    // Pruned: the rule the files no longer have is deleted.
    let (code, out, _) = floodgate(Some(&server), &["apply", "--prune", &toml2, &yaml]);
    assert_eq!(code, 0);
    assert!(
        out.contains("- monthly") && out.contains("1 changes applied"),
        "{out}"
    );
    let (code, _, _) = floodgate(Some(&server), &["get", "monthly"]);
    assert_eq!(code, 1, "deleted");
}
