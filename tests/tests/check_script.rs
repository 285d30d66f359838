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
    // Every key an item touches: a sliding window's two window hashes (even and odd windows).
    let keys = [
        "fg:{a}:tb:k:alice",
        "fg:{a}:sw:0:w0",
        "fg:{a}:sw:0:w1",
        "fg:{a}:tb:k:bob",
    ];
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
    let now_ms: Vec<u64> = redis::cmd("TIME").query(&mut conn).unwrap();
    let parity = (now_ms[0] * 1_000 + now_ms[1] / 1_000) / 3_600_000 % 2;
    assert_eq!(hashes, [format!("fg:{{a}}:sw:0:w{parity}")], "this window's hash");
    let count: i64 = redis::cmd("HGET")
        .arg(&hashes[0])
        .arg("alice")
        .query(&mut conn)
        .unwrap();
    assert_eq!(count, 2);

    // Malformed calls: an error each (the agent never sends these; a broken caller must not get a
    // verdict made of missing numbers), and nothing counted.
    let pair = ["fg:{a}:sw:0:w0", "fg:{a}:sw:0:w1"];
    let cases: [(&[&str], &[&str], &str); 5] = [
        (
            &pair,
            &["7", "5", "3600000", "5", "1", "1", "0", "carol", "1"],
            "unknown algorithm",
        ),
        (
            &pair,
            &["1", "5", "3600000", "5", "1", "1", "0"],
            "not 9 per item",
        ),
        (&pair, &["1", "5"], "not 9 per item"),
        // A sliding window given only one of its hashes, a token bucket given two keys.
        (
            &pair[..1],
            &["1", "5", "3600000", "5", "1", "1", "0", "carol", "1"],
            "1 keys where the items take 2",
        ),
        (
            &pair,
            &["2", "5", "3600000", "5", "1", "1", "0", "carol", "1"],
            "2 keys where the items take 1",
        ),
    ];
    for (keys, args, want) in cases {
        let err = eval(&mut conn, keys, args).expect_err("a malformed call is refused");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let carol: Option<i64> = redis::cmd("HGET")
        .arg(&hashes[0])
        .arg("carol")
        .query(&mut conn)
        .unwrap();
    assert_eq!(carol, None, "a refused call counts nothing");
}

/// A window hash (`:w0` even windows, `:w1` odd ones) found in the first milliseconds of a window
/// with less than a window to live is window i - 2's, still there because Redis expires keys by the
/// time a call started: it is deleted before it is counted in. One with more to live is the
/// window's own, and a call later in the window never looks. Driven through sliding_window.lua's
/// own function with a chosen clock.
#[test]
fn a_window_hash_left_from_two_windows_ago_is_not_counted_in() {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let driver = "local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
        local key = sliding_window_key_now(KEYS[1], KEYS[2], now, math.floor(now / window), window)
        return {key, redis.call('EXISTS', key)}";
    let script = format!("{}\n{driver}", include_str!("../../lua/sliding_window.lua"));
    let window = 60_000u64;
    let idx = 1_000_000u64; // even: its hash is :w0
    let mut case = |ttl_ms: u64, into_window_ms: u64| -> (String, i64) {
        let _: () = redis::cmd("HSET")
            .arg("h:w0")
            .arg("alice")
            .arg(7)
            .query(&mut conn)
            .unwrap();
        let _: () = redis::cmd("PEXPIRE")
            .arg("h:w0")
            .arg(ttl_ms)
            .query(&mut conn)
            .unwrap();
        redis::cmd("EVAL")
            .arg(&script)
            .arg(2)
            .arg("h:w0")
            .arg("h:w1")
            .arg(idx * window + into_window_ms)
            .arg(window)
            .query(&mut conn)
            .unwrap()
    };
    assert_eq!(
        case(30_000, 2),
        ("h:w0".into(), 0),
        "a stale hash in the window's first ms: deleted"
    );
    assert_eq!(case(90_000, 2), ("h:w0".into(), 1), "the window's own hash: kept");
    assert_eq!(
        case(30_000, 500),
        ("h:w0".into(), 1),
        "later in the window: not looked at"
    );
}
