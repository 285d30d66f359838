//! check.lua called directly on a real redis-server: its arguments carry each rule's parameters once
//! per call and four per item (issue 14's item 4), so an item must find its own rule's spec, and a
//! malformed call must get a clear error, never a verdict made of someone else's numbers.

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

    // Two specs: a sliding window of 5 per hour and a token bucket of 3 (burst 3) per hour. The first
    // item names spec 2, the second spec 1, the third spec 2 again (code = spec * 8 + mode * 2 + last:
    // enforce, each item its own check).
    let keys = ["fg:{a}:tb:k:alice", "fg:{a}:sw:0", "fg:{a}:tb:k:bob"];
    let args = [
        "2", // nspecs
        "1", "5", "3600000", "5", // spec 1: sliding window
        "2", "3", "3600000", "3", // spec 2: token bucket
        "19", "1", "0", "alice", // spec 2, enforce, last
        "11", "2", "0", "alice", // spec 1, enforce, last, cost 2
        "19", "3", "0", "bob", // spec 2, enforce, last, cost 3
    ];
    let out = eval(&mut conn, &keys, &args).expect("a well-formed call");
    assert_eq!(out.len(), 15, "5 figures per item: {out:?}");
    // allowed, limit, remaining for each item, from its own spec.
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

    // Malformed calls: a clear error each, and nothing counted.
    let one = ["fg:{a}:sw:0"];
    let cases: [(&[&str], &str); 5] = [
        (
            &["1", "1", "5", "3600000", "5", "11", "1", "0"],
            "expected nspecs",
        ),
        (
            &["x", "1", "5", "3600000", "5", "11", "1", "0", "carol"],
            "expected nspecs",
        ),
        (
            &["1", "7", "5", "3600000", "5", "11", "1", "0", "carol"],
            "unknown algorithm",
        ),
        (
            &["1", "1", "5", "3600000", "5", "19", "1", "0", "carol"],
            "names no spec",
        ),
        (
            &["1", "1", "5", "3600000", "5", "3", "1", "0", "carol"],
            "names no spec",
        ),
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
