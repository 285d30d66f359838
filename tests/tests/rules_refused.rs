//! An agent handed a rule set it must refuse (invalid as a whole, or an answer past the size bound)
//! keeps the set in force, says so in `/v1/status` and `floodgate_rules_refused`, and still starts:
//! with nothing in force it starts on the set's valid part rather than on no rule at all.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{agent_status, eventually, http_get, patient_client, Agent};

/// A rules service that answers every pull with what the test sets (status, body).
struct FakeService {
    answer: Arc<Mutex<(u16, Vec<u8>)>>,
    url: String,
}

impl FakeService {
    async fn start(body: String) -> Self {
        let answer = Arc::new(Mutex::new((200, body.into_bytes())));
        let served = answer.clone();
        let app = axum::Router::new().route(
            "/v1/rules",
            axum::routing::get(move || {
                let (status, body) = served.lock().unwrap().clone();
                async move {
                    (
                        axum::http::StatusCode::from_u16(status).unwrap(),
                        [("content-type", "application/json")],
                        body,
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        FakeService { answer, url }
    }

    fn answer(&self, body: Vec<u8>) {
        *self.answer.lock().unwrap() = (200, body);
    }
}

/// A descriptor rule answering domain `d`, key `k`, at `version`.
fn descriptor_rule(id: &str, version: u64) -> String {
    format!(
        r#"{{"id":"{id}","version":{version},"dimension":"descriptor","limit":5,"windowSeconds":60,"envoy":{{"domain":"d","descriptors":[{{"key":"k"}}]}}}}"#
    )
}

const PLAIN: &str = r#"{"id":"plain","version":1,"dimension":"user","limit":3,"windowSeconds":60}"#;

fn set(version: u64, rules: &[String]) -> String {
    format!(r#"{{"version":{version},"rules":[{}]}}"#, rules.join(","))
}

fn refused_gauge(text: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with("floodgate_rules_refused "))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_set_keeps_the_last_good_one_and_is_shown() {
    // Two rules answering one descriptor: what two racing writes stored before writes were
    // validated as a set. The agent has no cache: nothing in force.
    let invalid = set(
        5,
        &[
            PLAIN.into(),
            descriptor_rule("early", 3),
            descriptor_rule("late", 5),
        ],
    );
    let service = FakeService::start(invalid).await;
    let agent = Agent::builder()
        .arg("--rules-url")
        .arg(&service.url)
        .arg("--rules-poll-ms")
        .arg("100")
        .arg("--rules-watch-s")
        .arg("0")
        .start()
        .await;
    let status = eventually(
        "the agent takes the set's valid part",
        Duration::from_secs(10),
        || async {
            let s = agent_status(&agent).await;
            (s["rulesVersion"] == 5).then_some(s)
        },
    )
    .await;
    assert_eq!(status["rules"], serde_json::json!(["plain", "early"]), "{status}");
    assert_eq!(status["rulesRefused"]["version"], 5, "{status}");
    assert!(
        status["rulesRefused"]["error"]
            .as_str()
            .unwrap()
            .contains("both answer"),
        "{status}"
    );
    let admin = agent.admin_addr().await;
    let (_, text) = http_get(admin, "/metrics").await;
    assert_eq!(refused_gauge(&text), Some(1.0), "{text}");
    // The agent limits with what it has.
    let client = patient_client(agent.socket()).await;
    let d = client.allow("user:u", "plain", 1).await.unwrap();
    assert_eq!(
        (d.allowed, d.remaining, d.origin),
        (true, 2, Origin::Agent(Source::Local))
    );

    // A valid set: taken, the refusal cleared.
    service.answer(set(6, &[PLAIN.into(), descriptor_rule("early", 3)]).into_bytes());
    eventually("the valid set is taken", Duration::from_secs(10), || async {
        let s = agent_status(&agent).await;
        (s["rulesVersion"] == 6 && s["rulesRefused"].is_null()).then_some(())
    })
    .await;
    let (_, text) = http_get(admin, "/metrics").await;
    assert_eq!(refused_gauge(&text), Some(0.0), "{text}");

    // An invalid set now: refused, version 6 stays in force.
    service.answer(
        set(
            7,
            &[
                PLAIN.into(),
                descriptor_rule("early", 3),
                descriptor_rule("late", 7),
            ],
        )
        .into_bytes(),
    );
    let status = eventually("the invalid set is refused", Duration::from_secs(10), || async {
        let s = agent_status(&agent).await;
        (s["rulesRefused"]["version"] == 7).then_some(s)
    })
    .await;
    assert_eq!(status["rulesVersion"], 6, "{status}");
    assert_eq!(status["rules"], serde_json::json!(["plain", "early"]), "{status}");

    // An answer past the size bound (a hostile or mistaken service): refused without reading it
    // whole; the set in force stays and the agent keeps answering.
    let mut huge = set(8, &[PLAIN.into()]).into_bytes();
    huge.resize(floodgate_rules_service::http::MAX_ANSWER + 1, b' ');
    service.answer(huge);
    eventually(
        "the oversized answer is refused",
        Duration::from_secs(10),
        || async { agent.log().contains("is over 32 MiB").then_some(()) },
    )
    .await;
    assert_eq!(agent_status(&agent).await["rulesVersion"], 6);
    assert!(client.allow("user:u", "plain", 1).await.unwrap().allowed);
}
