//! Redis behind Sentinel: a real master, a replica and a sentinel; an agent on
//! `redis+sentinel://…/mymaster` under load while the sentinel fails the master over. No check is
//! lost: answers come from Redis, then (while the master is down and the sentinel promotes the
//! replica) from the fail mode, then from the new master, which runs the checks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate_sdk::{Origin, Source};
use floodgate_tests::{
    eventually, patient_client, replica_and_sentinel, replication_info, Agent, RedisServer,
};

const RULES: &str = r#"{"rules":[{"id":"api","dimension":"user","limit":1000000000,"windowSeconds":60}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_load_loses_no_check() {
    let mut master = RedisServer::start();
    let (replica, sentinel) = replica_and_sentinel(&master).await;

    let agent = Agent::builder()
        .redis(&format!(
            "redis+sentinel://127.0.0.1:{}/mymaster",
            sentinel.port()
        ))
        .rules(RULES)
        // Long enough that a loaded CI machine's answers are Redis's, short enough that a call to a
        // master mid-failover is answered by the fail mode at once rather than late.
        .arg("--redis-timeout-ms")
        .arg("200")
        .start()
        .await;
    let client = patient_client(agent.socket()).await;
    eventually("answers from the master", Duration::from_secs(10), || async {
        let d = client.allow("user:0", "api", 1).await.ok()?;
        (d.origin == Origin::Agent(Source::Redis)).then_some(())
    })
    .await;

    // Load: one check after another until told to stop; every answer recorded.
    let stop = Arc::new(AtomicBool::new(false));
    let answers: Arc<Mutex<Vec<Result<Origin, String>>>> = Arc::default();
    let load = {
        let (client, stop, answers) = (client.clone(), stop.clone(), answers.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = client.allow(&format!("user:{}", n % 1000), "api", 1).await;
                answers
                    .lock()
                    .unwrap()
                    .push(r.map(|d| d.origin).map_err(|e| e.to_string()));
                n += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The master dies; the sentinel (down after 1 s) promotes the replica. (A `SENTINEL FAILOVER`
    // would leave the old master up and writable for a while, and an agent keeps its connection to
    // a master that answers: it asks the sentinels again only when a call fails.)
    master.kill();
    eventually(
        "the sentinel names the replica master",
        Duration::from_secs(20),
        || async { (sentinel.master_port() == Some(replica.port())).then_some(()) },
    )
    .await;
    let failed_over_at = answers.lock().unwrap().len();
    let redis_again = || {
        let answers = answers.clone();
        async move {
            let a = answers.lock().unwrap();
            let after = a[failed_over_at..]
                .iter()
                .filter(|o| matches!(o, Ok(Origin::Agent(Source::Redis))))
                .count();
            (after >= 50).then_some(())
        }
    };
    eventually(
        "answers from the new master",
        Duration::from_secs(20),
        redis_again,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();

    let answers = answers.lock().unwrap();
    let errors: Vec<&String> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    assert!(errors.is_empty(), "no check may fail: {errors:?}");
    let not_agent = answers
        .iter()
        .filter(|a| !matches!(a, Ok(Origin::Agent(_))))
        .count();
    assert_eq!(
        not_agent,
        0,
        "every check answered by the agent ({} checks)",
        answers.len()
    );
    assert_eq!(replication_info(&replica, "role").as_deref(), Some("master"));
    // Replication copies keys (a DBSIZE would be above 0 before the failover) and, in Redis 7, a
    // script's effects, not the EVALSHA: EVALSHA calls on the promoted replica are the agent's own.
    assert!(
        floodgate_tests::command_calls(&replica, "evalsha") > 0,
        "the agent ran its checks on the new master"
    );
}
