//! check.lua called directly on a real redis-server, with the arguments the agent builds
//! (redis/'s call.rs): items of different rules in one call each read their own rule's
//! parameters, and a malformed call gets an error and counts nothing.

use floodgate_redis::CHECK_LUA;
use floodgate_tests::RedisServer;

/// EVAL of the check script; Ok(the flat reply) or Err(the Redis error's text).
fn eval(conn: &mut redis::Connection, keys: &[&str], args: &[&str]) -> Result<Vec<i64>, String> {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(CHECK_LUA).arg(keys.len());
    for k in keys {
        cmd.arg(*k);
    }
    for a in args {
        cmd.arg(*a);
    }
    cmd.query::<Vec<i64>>(conn).map_err(|e| e.to_string())
}

#[test]
fn each_item_reads_its_own_spec_and_bad_calls_are_refused() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();

    // Two rules in one call: a sliding window of 5 per hour and a token bucket of 3 (burst 3) per
    // hour; nine arguments per item (algorithm, limit, window_ms, burst, cost, mode, target, field,
    // last), each item its own check, enforced.
    let keys = ["fg:{a}:tb:k:alice", "fg:{a}:sw:0", "fg:{a}:tb:k:bob"];
    let args = [
        "2", "3", "3600000", "3", "1", "1", "0", "alice", "1", // token bucket, cost 1
        "1", "5", "3600000", "5", "2", "1", "0", "alice", "1", // sliding window, cost 2
        "2", "3", "3600000", "3", "3", "1", "0", "bob", "1", // token bucket, cost 3
    ];
    let out = eval(&mut conn, &keys, &args).expect("a well-formed call");
    assert_eq!(out.len(), 15, "5 figures per item: {out:?}");
    // allowed, limit, remaining for each item, from its own rule.
    assert_eq!(&out[0..3], &[1, 3, 2], "token bucket, cost 1 of 3: {out:?}");
    assert_eq!(&out[5..8], &[1, 5, 3], "sliding window, cost 2 of 5: {out:?}");
    assert_eq!(&out[10..13], &[1, 3, 0], "token bucket, cost 3 of 3: {out:?}");
    // The state landed where the keys say: the sliding window's hash of this window holds alice's 2.
    let hashes: Vec<String> = redis::cmd("KEYS").arg("fg:{a}:sw:0:*").query(&mut conn).unwrap();
    assert_eq!(hashes.len(), 1, "{hashes:?}");
    let count: i64 = redis::cmd("HGET")
        .arg(&hashes[0])
        .arg("alice")
        .query(&mut conn)
        .unwrap();
    assert_eq!(count, 2);

    // Malformed calls: an error each (the agent never sends these; a broken caller must not get a
    // verdict made of missing numbers), and nothing counted.
    let one = ["fg:{a}:sw:0"];
    let cases: [(&[&str], &str); 3] = [
        (
            &["7", "5", "3600000", "5", "1", "1", "0", "carol", "1"],
            "unknown algorithm",
        ),
        (&["1", "5", "3600000", "5", "1", "1", "0"], ""),
        (&["1", "5"], ""),
    ];
    for (args, want) in cases {
        let err = eval(&mut conn, &one, args).expect_err("a malformed call is refused");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let carol: Option<i64> = redis::cmd("HGET")
        .arg(&hashes[0])
        .arg("carol")
        .query(&mut conn)
        .unwrap();
    assert_eq!(carol, None, "a refused call counts nothing");
}
