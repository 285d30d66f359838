//! What a request is checked as: the extractors (the matched route, headers, the peer address and
//! `X-Forwarded-For` believed only from trusted proxies), and values made wire-safe.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::request::Parts;

/// Reads one attribute off a request.
pub type Extractor = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// The peer's address, for servers that are not axum: insert it into the request's extensions
/// (axum's `ConnectInfo<SocketAddr>` is read too, with the `axum` feature).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// An address block, `10.0.0.0/8` or a single address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

/// Why a block of trusted proxies was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// Neither an address nor `address/prefix`.
    #[error("{0:?} is not an IP address or CIDR block")]
    NotAnAddress(String),
    /// A prefix past the address's bits.
    #[error("{0:?}: the prefix must be 0..={1}")]
    Prefix(String, u8),
}

impl Cidr {
    /// Parses `addr/prefix` or `addr`.
    pub fn parse(s: &str) -> Result<Cidr, CidrError> {
        let (a, p) = s.split_once('/').unwrap_or((s, ""));
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| CidrError::NotAnAddress(s.to_string()))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() {
            max
        } else {
            p.trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| CidrError::Prefix(s.to_string(), max))?
        };
        // An IPv4-mapped block is the IPv4 block (addresses are compared mapped-to-IPv4 too).
        if let IpAddr::V6(v6) = addr {
            if let (Some(v4), true) = (v6.to_ipv4_mapped(), prefix >= 96) {
                return Ok(Cidr {
                    addr: IpAddr::V4(v4),
                    prefix: prefix - 96,
                });
            }
        }
        Ok(Cidr { addr, prefix })
    }

    /// Whether `ip` is in the block (an IPv4-mapped IPv6 address counts as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

pub(super) fn header_extractor(name: &'static str) -> Extractor {
    Arc::new(move |p: &Parts| {
        p.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    })
}

pub(super) fn default_endpoint(p: &Parts) -> Option<String> {
    #[cfg(feature = "axum")]
    if let Some(m) = p.extensions.get::<axum::extract::MatchedPath>() {
        return Some(route_name(m.as_str()));
    }
    Some(p.uri.path().to_string())
}

/// A route as the agent may see it: axum's `{param}` and `{*rest}` become `:param` and `*rest`
/// (braces are refused on the wire, since Redis reads them as hash tags). Rules and
/// [`RateLimitLayer::cost`] name routes either way.
pub fn route_name(route: &str) -> String {
    route
        .split('/')
        .map(
            |seg| match seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(inner) if inner.starts_with('*') => inner.to_string(),
                Some(inner) => format!(":{inner}"),
                None => seg.to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join("/")
}

fn peer(p: &Parts) -> Option<IpAddr> {
    if let Some(PeerAddr(a)) = p.extensions.get::<PeerAddr>() {
        return Some(a.ip());
    }
    #[cfg(feature = "axum")]
    if let Some(c) = p.extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(c.0.ip());
    }
    None
}

/// The client's address: the peer, unless the peer is a trusted proxy; then `X-Forwarded-For` read
/// from the right, skipping trusted proxies, up to the first address they did not vouch for. A
/// client can write anything at the left of the header; only what trusted proxies appended counts.
pub fn client_ip(p: &Parts, trusted: &[Cidr]) -> Option<IpAddr> {
    let peer = peer(p)?;
    if !trusted.iter().any(|c| c.contains(peer)) {
        return Some(peer);
    }
    let mut client = peer;
    let hops = p
        .headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for hop in hops.into_iter().rev() {
        let Ok(ip) = hop.parse::<IpAddr>() else {
            // Garbage where an address should be: stop at the last address we could vouch for.
            break;
        };
        client = ip;
        if !trusted.iter().any(|c| c.contains(ip)) {
            break;
        }
    }
    Some(client)
}

/// A value the agent accepts (see [`floodgate_protocol::http::wire_safe`]: as it is when the wire
/// allows it, else `h:` and its 64-bit FNV-1a hash).
pub fn wire_safe(value: String) -> String {
    floodgate_protocol::http::wire_safe(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Attributes;
    use http::Request;

    fn parts(peer: &str, xff: &[&str]) -> Parts {
        let mut b = Request::builder().uri("/x");
        for v in xff {
            b = b.header("x-forwarded-for", *v);
        }
        let (mut p, _) = b.body(()).unwrap().into_parts();
        p.extensions.insert(PeerAddr(peer.parse().unwrap()));
        p
    }

    #[test]
    fn forwarded_for_is_believed_only_from_trusted_proxies() {
        let trusted = vec![Cidr::parse("10.0.0.0/8").unwrap(), Cidr::parse("::1").unwrap()];
        let ip = |peer, xff: &[&str]| client_ip(&parts(peer, xff), &trusted).unwrap().to_string();
        // Not from a proxy: the header is the client's own words, ignored.
        assert_eq!(ip("203.0.113.9:1", &["1.2.3.4"]), "203.0.113.9");
        // From a proxy: the rightmost address it did not vouch for.
        assert_eq!(
            ip("10.0.0.2:1", &["6.6.6.6, 198.51.100.7, 10.0.0.5"]),
            "198.51.100.7"
        );
        // Several header lines count as one list, in order.
        assert_eq!(ip("10.0.0.2:1", &["6.6.6.6", "198.51.100.7"]), "198.51.100.7");
        // Garbage stops the walk at the last trusted hop.
        assert_eq!(ip("10.0.0.2:1", &["198.51.100.7, bogus"]), "10.0.0.2");
        // A proxy without the header: the proxy is the client.
        assert_eq!(ip("[::1]:1", &[]), "::1");
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("::ffff:10.1.2.3")
            .unwrap()
            .contains("10.1.2.3".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/8")
            .unwrap()
            .contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
    }

    #[test]
    fn odd_values_become_stable_hashes_the_wire_accepts() {
        assert_eq!(wire_safe("alice".into()), "alice");
        let brace = wire_safe("{".into());
        assert!(brace.starts_with("h:") && brace.len() == 18, "{brace}");
        assert_eq!(brace, wire_safe("{".into()), "stable");
        assert_ne!(brace, wire_safe("}".into()));
        let long = wire_safe("x".repeat(300));
        let a = Attributes {
            user: Some(long),
            tier: Some(wire_safe("a\u{7}b".into())),
            cost: 1,
            ..Default::default()
        };
        assert_eq!(a.validate(), Ok(()));
        // The example's mapped block holds 10.0.0.0/8 addresses however they are written.
        let mapped = Cidr::parse("::ffff:10.0.0.0/104").unwrap();
        assert!(mapped.contains("10.9.9.9".parse().unwrap()));
        assert!(mapped.contains("::ffff:10.9.9.9".parse().unwrap()));
        assert!(!mapped.contains("11.0.0.1".parse().unwrap()));
    }

    #[test]
    fn routes_lose_their_braces() {
        assert_eq!(route_name("/items/{id}/parts/{*rest}"), "/items/:id/parts/*rest");
        assert_eq!(route_name("/plain/path"), "/plain/path");
    }
}
