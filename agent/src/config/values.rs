//! The agent's flag values that are not plain numbers or paths: the admin address, the log format,
//! file modes, the gRPC address, the HTTP listeners' limits, and their parsers.

use std::net::SocketAddr;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable text.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Where the admin HTTP API listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admin {
    /// Not served.
    Off,
    /// Served at this address (port 0 picks a free one, logged at start).
    At(SocketAddr),
}

/// An HTTP listener's limits from its two flags.
pub fn http_limits(
    max_connections: usize,
    header_timeout_ms: u64,
) -> floodgate_rules_service::listen::Limits {
    floodgate_rules_service::listen::Limits::new(max_connections)
        .header_timeout(std::time::Duration::from_millis(header_timeout_ms))
}

/// `--http-max-connections`: 1 to 1,000,000 (past a million the file descriptors run out first).
pub(super) fn http_max_connections() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..=1_000_000)
}

/// `--http-header-timeout-ms`: 1 ms to 10 minutes.
pub(super) fn http_header_timeout_ms() -> clap::builder::RangedU64ValueParser<u64> {
    clap::builder::RangedU64ValueParser::new().range(1..=600_000)
}

pub(super) fn parse_mode(s: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|e| format!("{s:?} is not an octal mode: {e}"))?;
    if mode > 0o777 {
        return Err(format!("{s:?} is not a file mode (0000 to 0777)"));
    }
    Ok(mode)
}

pub(super) fn parse_grpc(s: &str) -> Result<SocketAddr, String> {
    if s.eq_ignore_ascii_case("on") {
        return Ok(SocketAddr::from(([127, 0, 0, 1], 8081)));
    }
    s.parse()
        .map_err(|e| format!("{s:?} is not an address like 127.0.0.1:8081 or on: {e}"))
}

pub(super) fn parse_admin(s: &str) -> Result<Admin, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(Admin::Off);
    }
    s.parse()
        .map(Admin::At)
        .map_err(|e| format!("{s:?} is not an address like 127.0.0.1:9790 or off: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_and_addresses_parse() {
        assert_eq!(parse_mode("0660"), Ok(0o660));
        assert_eq!(parse_mode("600"), Ok(0o600));
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("1777").is_err());
        assert_eq!(parse_admin("off"), Ok(Admin::Off));
        assert_eq!(
            parse_admin("127.0.0.1:0"),
            Ok(Admin::At("127.0.0.1:0".parse().unwrap()))
        );
        assert!(parse_admin("localhost").is_err());
        assert_eq!(parse_grpc("on"), Ok("127.0.0.1:8081".parse().unwrap()));
        assert!(parse_grpc("8081").is_err());
    }
}
