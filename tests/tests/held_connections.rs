//! One client holding a listener's worth of idle and half-sent connections does not stop the
//! agent limiting everyone else: its connections past its share of the cap are refused (Error 7,
//! naming the share), the half-sent ones are closed when their frame times out, the idle ones when
//! they have been idle too long, the agent's memory stays bounded, and another client's checks are
//! all answered by the engine meanwhile.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use floodgate_protocol::{Body, ErrorCode, MAX_FRAME};
use floodgate_tests::{eventually, http_get, Agent, RawConn};

const RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","limit":1000000,"windowSeconds":60}]}"#;

/// The agent's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The head of a frame announcing nearly 64 KiB, and 60 KiB of its body: what a half-sent frame
/// makes the agent buffer.
fn half_frame() -> Vec<u8> {
    let mut bytes = ((MAX_FRAME - 4) as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(&[1, 3, 0, 0, 0, 1]);
    bytes.resize(60 * 1024, b'x');
    bytes
}

fn counter(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holding_the_cap_leaves_others_answered_by_the_engine() {
    const CAP: usize = 64;
    const SHARE: usize = 16;
    let agent = Agent::builder()
        .rules(RULES)
        .arg("--listen-tcp")
        .arg("127.0.0.1:0")
        .arg("--max-connections")
        .arg(&CAP.to_string())
        .arg("--max-connections-per-peer")
        .arg(&SHARE.to_string())
        .arg("--frame-timeout-ms")
        .arg("1000")
        .arg("--idle-timeout-ms")
        .arg("3000")
        .start()
        .await;
    let addr = agent.logged_addr("frames protocol on TCP").await;
    let admin = agent.admin_addr().await;
    let pid = agent.pid().unwrap();
    let legit = floodgate_tests::patient_client(std::path::Path::new(&format!("tcp://{addr}"))).await;
    assert!(legit
        .allow("user:ok", "api", 1)
        .await
        .unwrap()
        .from_agent_answer());
    let rss_before = rss_kib(pid);

    // The hostile client, from another address: the whole cap's worth of connections.
    let hostile = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let mut conns = Vec::new();
    for _ in 0..CAP {
        conns.push(RawConn::connect_tcp_from(hostile, addr).await.unwrap());
    }
    // Every refusal is counted before its Error is written: once all are counted, give the Errors a
    // second to arrive (all connections at once), then a connection that heard nothing is held.
    eventually("the refusals are counted", Duration::from_secs(10), || async {
        let (_, text) = http_get(admin, "/metrics").await;
        (counter(&text, "floodgate_connections_refused_total{listener=\"tcp\"}") >= (CAP - SHARE) as f64)
            .then_some(())
    })
    .await;
    let heard = futures::future::join_all(
        conns
            .iter_mut()
            .map(|c| async move { tokio::time::timeout(Duration::from_secs(1), c.recv()).await.ok() }),
    )
    .await;
    let mut held = Vec::new();
    let mut refused = 0;
    for (c, heard) in conns.into_iter().zip(heard) {
        match heard {
            None => held.push(c),
            Some(Some(f)) => match f.body {
                Body::Error(e) => {
                    assert_eq!(e.code, ErrorCode::Overloaded);
                    assert!(
                        e.message.contains("127.0.0.2 holds its share of 16"),
                        "{}",
                        e.message
                    );
                    refused += 1;
                }
                other => panic!("{other:?}"),
            },
            Some(None) => panic!("closed without an Error"),
        }
    }
    assert_eq!((held.len(), refused), (SHARE, CAP - SHARE));
    // Half of what it holds sends a frame's head and 60 KiB of its body, then nothing.
    let (mut half, idle): (Vec<_>, Vec<_>) = held.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    for (_, c) in &mut half {
        c.send_bytes(&half_frame()).await.unwrap();
    }
    let rss_held = rss_kib(pid);

    // Meanwhile every check of the other client is the engine's answer.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(500) {
        let d = legit.allow("user:ok", "api", 1).await.unwrap();
        assert!(d.from_agent_answer(), "{d:?}");
    }

    // The half-sent connections are closed with an Error once their frame times out (1 s)...
    for (_, mut c) in half {
        match c.recv().await.expect("an Error before the close").body {
            Body::Error(e) => {
                assert_eq!(e.code, ErrorCode::MalformedFrame);
                assert!(e.message.contains("not completed within"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
        assert!(c.recv().await.is_none(), "then closed");
    }
    // ...and the idle ones once idle for 3 s.
    for (_, mut c) in idle {
        assert!(c.recv().await.is_none(), "closed when idle");
    }
    // The buffers of the half-sent frames were given back, and were never more than their bytes.
    assert!(
        rss_held < rss_before + 8 * 1024,
        "RSS {rss_before} KiB before, {rss_held} KiB holding 8 half-sent 64 KiB frames"
    );
    let d = legit.allow("user:ok", "api", 1).await.unwrap();
    assert!(d.from_agent_answer(), "{d:?}");
    let (_, text) = http_get(admin, "/metrics").await;
    assert_eq!(
        counter(&text, "floodgate_connections_refused_total{listener=\"tcp\"}"),
        (CAP - SHARE) as f64
    );
    assert_eq!(
        counter(
            &text,
            "floodgate_connections_closed_total{reason=\"frame_timeout\"}"
        ),
        8.0,
        "{text}"
    );
    // The legitimate client's connection was busy, so it is not among the idle ones.
    assert_eq!(
        counter(&text, "floodgate_connections_closed_total{reason=\"idle\"}"),
        8.0,
        "{text}"
    );
    // A new connection of the hostile address is served again.
    let mut again = RawConn::connect_tcp_from(hostile, addr).await.unwrap();
    again
        .send(&floodgate_protocol::Frame::new(
            1,
            Body::Check(floodgate_protocol::Check::Items(vec![
                floodgate_protocol::Item::new("user:h", "api", 1),
            ])),
        ))
        .await
        .unwrap();
    assert!(matches!(again.recv().await.unwrap().body, Body::Decision(_)));
}

/// The same on the Unix socket, where a peer is a process and its uid (`SO_PEERCRED`): another
/// user's process holding the cap's worth of connections gets a quarter of its user's share (4 of
/// 16) and no more, and this process's checks are answered by the engine. Needs root, to run the
/// other user's client as `nobody`; CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_user_holding_the_socket_gets_its_share_only() {
    use std::io::{BufRead, Write};
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        eprintln!("skipped: running another user's client needs root (CI runs as root)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = Agent::builder()
        .rules(RULES)
        .socket(&socket)
        .arg("--socket-mode")
        .arg("0666")
        .arg("--max-connections")
        .arg("64")
        .arg("--max-connections-per-peer")
        .arg("16")
        .start()
        .await;
    // nobody's client: opens 64 connections, counts those refused with an Error within a second,
    // reports, and holds the rest until its stdin closes.
    let script = r#"
import socket, select, sys
held, refused = [], 0
conns = []
for _ in range(64):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    conns.append(s)
import time
deadline = time.monotonic() + 1.0
answered = set()
while time.monotonic() < deadline:
    waiting = [s for s in conns if s not in answered]
    ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
    answered.update(ready)
for s in conns:
    if s in answered and len(s.recv(4096)) > 0:
        refused += 1
    else:
        held.append(s)
print(f"held {len(held)} refused {refused}", flush=True)
sys.stdin.read()
"#;
    // The system's python (a per-user install such as root's pyenv is not nobody's to run).
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
        .unwrap();
    let mut nobody = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            python,
            "-c",
            script,
        ])
        .arg(&socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(nobody.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "held 4 refused 60");
    // This process (root, another peer) is served while nobody holds its share.
    let client = floodgate_tests::patient_client(agent.socket()).await;
    for _ in 0..100 {
        let d = client.allow("user:ok", "api", 1).await.unwrap();
        assert!(d.from_agent_answer(), "{d:?}");
    }
    let mut stdin = nobody.stdin.take().unwrap();
    let _ = stdin.write_all(b"");
    drop(stdin);
    nobody.wait().unwrap();
}

/// A process of this test's own user holding 200 connections to a socket capped at 64 (a share of
/// 16 for the user): it gets a quarter of the user's share, and this process, of the same user, is
/// still let in and has 8 of 8 checks answered by the engine. Before a process had a share of its
/// own, the greedy one took the whole user's share and every other process of the user got Error 7,
/// and so ran by its fail policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_holding_its_users_share_leaves_the_users_other_processes_served() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = Agent::builder()
        .rules(RULES)
        .socket(&socket)
        .arg("--max-connections")
        .arg("64")
        .arg("--max-connections-per-peer")
        .arg("16")
        .start()
        .await;
    let script = r#"
import socket, sys
held = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
        held.append(s)
    except OSError:
        pass
print("connected", flush=True)
sys.stdin.read()
"#;
    let mut greedy = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(&socket)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(greedy.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "connected");
    // The agent refused all but 4 of them (the refusals counted as they happen).
    let admin = agent.admin_addr().await;
    eventually("196 refusals are counted", Duration::from_secs(10), || async {
        let (_, text) = http_get(admin, "/metrics").await;
        (counter(&text, "floodgate_connections_refused_total{listener=\"unix\"}") >= 196.0).then_some(())
    })
    .await;
    let client = floodgate_sdk::Client::connect(agent.socket()).await;
    let mut answered = 0;
    for i in 0..8 {
        let d = client.allow(&format!("user:{i}"), "api", 1).await.unwrap();
        answered += usize::from(d.from_agent_answer());
    }
    assert_eq!(answered, 8, "8 of 8 checks answered by the engine");
    let mut stdin = greedy.stdin.take().unwrap();
    let _ = stdin.write_all(b"");
    drop(stdin);
    greedy.wait().unwrap();
}

/// Four greedy peers (loopback addresses 127.0.0.2 to .5) each holding every connection they can
/// get on the frames TCP, gRPC and admin listeners; another peer still has its checks answered by
/// the engine over TCP, opens a new gRPC connection and is answered, and gets `/healthz`. Before
/// the last eighth of each cap was kept for peers that hold none, four peers at their quarter
/// share filled every listener: new clients got Error 7 and `/healthz` went unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_greedy_peers_leave_room_for_another() {
    use floodgate_agent::envoy::proto::{Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest};
    use floodgate_tests::raw_http::{connect_from, half_sent};
    use tokio::io::AsyncWriteExt;
    let agent = Agent::builder()
        .rules(
            r#"{"rules":[{"id":"api","dimension":"user","limit":1000000,"windowSeconds":60},
              {"id":"edge-user","dimension":"descriptor","limit":100,"windowSeconds":60,
               "envoy":{"domain":"edge","descriptors":[{"key":"user"}]}}]}"#,
        )
        .arg("--listen-tcp")
        .arg("127.0.0.1:0")
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--max-connections")
        .arg("64")
        .arg("--http-max-connections")
        .arg("16")
        .start()
        .await;
    let tcp = agent.logged_addr("frames protocol on TCP").await;
    let grpc = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let admin = agent.admin_addr().await;
    let mut held = Vec::new();
    for last in 2..=5u8 {
        let from = IpAddr::V4(Ipv4Addr::new(127, 0, 0, last));
        for _ in 0..64 {
            held.push(connect_from(from, tcp).await);
            let mut g = connect_from(from, grpc).await;
            // A gRPC connection that opened properly, so the frame timeout does not end it.
            let _ = g
                .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
                .await;
            held.push(g);
        }
        for _ in 0..16 {
            held.push(half_sent(from, admin, "/healthz").await);
        }
    }
    // Another peer (127.0.0.1): frames over TCP, a new gRPC connection, and the health probe.
    let client = floodgate_tests::patient_client(std::path::Path::new(&format!("tcp://{tcp}"))).await;
    for i in 0..8 {
        let d = client.allow(&format!("user:{i}"), "api", 1).await.unwrap();
        assert!(d.from_agent_answer(), "{d:?}");
    }
    let mut rls = RateLimitClient::connect(format!("http://{grpc}")).await.unwrap();
    let r = rls
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "u1".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        })
        .await
        .unwrap();
    assert_eq!(r.statuses[0].limit_remaining, 99);
    let (status, body) = http_get(admin, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    // The greedy peers were held to their shares: 16 of 64 each, less what the kept slots refused.
    let (_, text) = http_get(admin, "/metrics").await;
    assert!(
        counter(&text, "floodgate_connections_refused_total{listener=\"tcp\"}") >= 4.0 * 48.0,
        "{text}"
    );
    drop(held);
}
