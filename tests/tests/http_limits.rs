//! The HTTP listeners' connection caps and timeouts, against real processes: one client that opens
//! the cap's worth of half-sent requests holds only its share (a quarter) while operators are
//! answered, its half-sent requests are closed after the header timeout, a kept-alive connection
//! after the same idle time, and the cap holds across peers until the timeout frees it.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use floodgate_tests::raw_http::{closed, connect_from, exchange, half_sent};
use floodgate_tests::{eventually, Agent, RulesServer};
use tokio::net::TcpStream;

/// The cap the tests run with: a quarter of it (4) per peer address.
const CAP: usize = 16;
const SHARE: usize = CAP / 4;

/// The header timeout the tests run with: long enough that the connections refused at once are seen
/// closed well before the held ones time out on a loaded machine, short enough to wait out.
const HEADER_TIMEOUT: Duration = Duration::from_secs(3);

/// Well past the header timeout: patience for what must happen by then.
const PATIENCE: Duration = Duration::from_secs(15);

fn limits() -> [String; 4] {
    [
        "--http-max-connections".into(),
        CAP.to_string(),
        "--http-header-timeout-ms".into(),
        HEADER_TIMEOUT.as_millis().to_string(),
    ]
}

fn loopback(last: u8) -> IpAddr {
    [127, 0, 0, last].into()
}

/// Waits until `n` of `conns` are closed by the server; returns the ones still open.
async fn until_closed(what: &str, conns: Vec<TcpStream>, n: usize) -> Vec<TcpStream> {
    let mut conns = conns;
    let mut gone = 0;
    eventually(what, PATIENCE, || {
        let before = conns.len();
        conns.retain(|c| !closed(c));
        gone += before - conns.len();
        let done = gone >= n;
        async move { done.then_some(()) }
    })
    .await;
    conns
}

/// One client (127.0.0.1) opens the cap's worth of half-sent requests to `addr`: all but its share
/// are closed at once, and the share is held open (still open when this returns).
async fn flood(addr: SocketAddr, path: &str) -> (Vec<TcpStream>, Instant) {
    let opened = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..CAP {
        conns.push(half_sent(loopback(1), addr, path).await);
    }
    let held = until_closed(
        "the connections past the client's share are closed at once",
        conns,
        CAP - SHARE,
    )
    .await;
    assert_eq!(held.len(), SHARE, "the client holds its share, no more");
    (held, opened)
}

/// The held half-sent requests are closed after the header timeout (not before).
async fn closed_after_the_header_timeout(held: Vec<TcpStream>, opened: Instant) {
    until_closed("the half-sent requests are closed", held, SHARE).await;
    assert!(
        opened.elapsed() >= HEADER_TIMEOUT,
        "closed after {:?}, before the header timeout",
        opened.elapsed()
    );
}

async fn rules_server(dir: &tempfile::TempDir) -> RulesServer {
    let extra = limits();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    RulesServer::start_with(
        &format!("sqlite://{}", dir.path().join("r.db").display()),
        &["ops:s3cret"],
        &extra,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_server_answers_operators_while_one_client_holds_half_sent_requests() {
    let dir = tempfile::tempdir().unwrap();
    let s = rules_server(&dir).await;
    let (held, opened) = flood(s.addr(), "/v1/rules").await;

    // The same client gets no more: its next connection is closed at once too.
    let extra = half_sent(loopback(1), s.addr(), "/v1/rules").await;
    until_closed("the client's next connection is closed", vec![extra], 1).await;

    // An operator elsewhere is answered, while the flood still holds its connections.
    let mut op = connect_from(loopback(2), s.addr()).await;
    let asked = Instant::now();
    let (status, _, body) = exchange(
        &mut op,
        "GET /v1/rules HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        held.iter().all(|c| !closed(c)),
        "the operator was answered while the half-sent requests were held"
    );

    closed_after_the_header_timeout(held, opened).await;
    // The operator's kept-alive connection, idle since its answer, is closed after the same time.
    until_closed("the idle kept-alive connection is closed", vec![op], 1).await;
    assert!(asked.elapsed() >= HEADER_TIMEOUT, "{:?}", asked.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_server_cap_holds_across_peers_until_the_header_timeout_frees_it() {
    let dir = tempfile::tempdir().unwrap();
    let s = rules_server(&dir).await;
    // Four peers take all they can: 14 of the 16, since the last eighth of the cap (2) is kept
    // for peers that hold no connection yet.
    let opened = Instant::now();
    let mut conns = Vec::new();
    for peer in 1..=4 {
        for _ in 0..SHARE {
            conns.push(half_sent(loopback(peer), s.addr(), "/v1/rules").await);
        }
    }
    let mut held = until_closed("the fourth peer's last two are refused", conns, 2).await;
    assert_eq!(held.len(), CAP - CAP / 8);
    // A fifth peer, holding nothing, gets a kept slot; a sixth of the same host (127.0.0.0/8 takes
    // at most a quarter of the kept slots, at least one) does not, and the cap is full for all.
    let fifth = half_sent(loopback(5), s.addr(), "/v1/rules").await;
    let sixth = half_sent(loopback(6), s.addr(), "/v1/rules").await;
    until_closed("a sixth peer of the same host is refused", vec![sixth], 1).await;
    assert!(!closed(&fifth), "the fifth peer holds a kept slot");
    held.push(fifth);
    assert!(held.iter().all(|c| !closed(c)), "the cap's connections are held");
    closed_after_the_header_timeout_all(held, opened).await;
    // The slots are free again.
    let mut op = connect_from(loopback(5), s.addr()).await;
    let (status, _, body) = exchange(
        &mut op,
        "GET /v1/rules HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

async fn closed_after_the_header_timeout_all(held: Vec<TcpStream>, opened: Instant) {
    let n = held.len();
    until_closed("the half-sent requests are closed", held, n).await;
    assert!(opened.elapsed() >= HEADER_TIMEOUT, "{:?}", opened.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_http_listeners_answer_while_one_client_holds_half_sent_requests() {
    let mut agent = Agent::builder();
    for a in limits() {
        agent = agent.arg(&a);
    }
    let agent = agent.start().await;
    let admin = agent.admin_addr().await;
    let rules = agent.rules_addr().await;
    for (addr, label, path) in [(admin, "admin", "/metrics"), (rules, "rules", "/v1/rules")] {
        let (held, opened) = flood(addr, path).await;
        // The admin API answers from another address meanwhile, and counts the refusals.
        let mut op = connect_from(loopback(2), admin).await;
        let (status, _, metrics) = exchange(
            &mut op,
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(status, 200, "{metrics}");
        let series = format!("floodgate_connections_refused_total{{listener=\"{label}\"}} ");
        let refused: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} in\n{metrics}"));
        assert_eq!(refused, (CAP - SHARE) as f64);
        assert!(
            held.iter().all(|c| !closed(c)),
            "answered while the half-sent requests were held"
        );
        closed_after_the_header_timeout(held, opened).await;
    }
}

/// A request without a valid token is answered and its connection closed (`Connection: close`), so
/// clients that cannot authenticate hold no kept-alive slot; an authenticated client's connection
/// stays open for its next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rules_server_closes_a_connection_that_cannot_authenticate() {
    let dir = tempfile::tempdir().unwrap();
    let s = rules_server(&dir).await;
    for auth in ["", "Authorization: Bearer wrong\r\n"] {
        let mut c = connect_from(loopback(1), s.addr()).await;
        let (status, head, _) = exchange(
            &mut c,
            &format!("GET /v1/rules HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n"),
        )
        .await;
        assert!(status == 401 || status == 403, "{status} {head}");
        assert!(head.to_ascii_lowercase().contains("connection: close"), "{head}");
        until_closed("a refused client's connection", vec![c], 1).await;
    }
    let mut c = connect_from(loopback(1), s.addr()).await;
    for _ in 0..2 {
        let (status, head, _) = exchange(
            &mut c,
            "GET /v1/rules HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret\r\n\r\n",
        )
        .await;
        assert_eq!(status, 200, "{head}");
    }
    assert!(!closed(&c), "an authenticated client's connection stays open");
}
