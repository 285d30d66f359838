//! Redis failures classified (timeout, connection, script, server), so that the rule's fail mode and
//! the shard's breaker decide on a kind, not on a string.

use std::time::Duration;

use redis::{ErrorKind, RedisError};

use floodgate_core::store::StoreError;

/// A redis-rs error classified: a timeout, a lost or refused connection, an error reply of the
/// server's state or of the script (see [`reply_error`]), anything else a script error.
pub(super) fn classify(e: RedisError) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(Duration::ZERO)
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        StoreError::Connection(e.to_string())
    } else {
        match e.kind() {
            ErrorKind::Server(_) => reply_error(e.code().unwrap_or(""), e.to_string()),
            _ => StoreError::Script(e.to_string()),
        }
    }
}

/// Error codes that say the server (not the script) cannot serve now: the breaker's business.
const SERVER_CODES: &[&str] = &[
    "OOM",
    "READONLY",
    "BUSY",
    "LOADING",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "MISCONF",
    "NOREPLICAS",
    "TRYAGAIN",
    "MOVED",
    "ASK",
    "NOAUTH",
    "WRONGPASS",
    "NOPERM",
    "NOSCRIPT",
];

/// An error reply classified: one the script raised on its data (Redis names the script's line,
/// `@user_script:N`, or check.lua's own `ERR floodgate:`) is [`StoreError::Script`]: Redis is there
/// and answered, so it must not open the shard's breaker for every rule; one of the server's state
/// (OOM, READONLY, BUSY, …, even when raised inside the script) is [`StoreError::Server`].
pub(crate) fn reply_error(code: &str, text: String) -> StoreError {
    let code = if code.is_empty() {
        text.split_whitespace().next().unwrap_or("")
    } else {
        code
    };
    if SERVER_CODES.contains(&code) {
        StoreError::Server(text)
    } else if text.contains("@user_script") || text.starts_with("ERR floodgate:") {
        StoreError::Script(text)
    } else {
        StoreError::Server(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_errors_are_told_from_the_servers_state() {
        // Redis 7.0's own texts.
        let script = [
            "WRONGTYPE Operation against a key holding the wrong kind of value script: 085e, on @user_script:1.",
            "ERR value is not an integer or out of range script: 7871, on @user_script:1.",
            "ERR user_script:1: attempt to perform arithmetic on a nil value script: d13b, on @user_script:1.",
            "ERR floodgate: unknown algorithm 7",
        ];
        for text in script {
            assert!(
                matches!(reply_error("", text.into()), StoreError::Script(_)),
                "{text}"
            );
        }
        let server = [
            "OOM command not allowed when used memory > 'maxmemory'. script: 085e, on @user_script:1.",
            "READONLY You can't write against a read only replica. script: 085e, on @user_script:1.",
            "BUSY Redis is busy running a script.",
            "LOADING Redis is loading the dataset in memory",
            "ERR max number of clients reached",
        ];
        for text in server {
            assert!(
                matches!(reply_error("", text.into()), StoreError::Server(_)),
                "{text}"
            );
        }
    }
}
