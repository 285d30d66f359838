//! Keeping web pages out of the APIs that ask for no token and trust loopback (the agent's admin
//! API, its embedded rules API, a rules service run without `--token`): a foreign `Host` (DNS
//! rebinding), a cross-site write, a form post.
//!
//! A page at `evil.example` whose name resolves to 127.0.0.1 is, to the browser, same-origin with
//! whatever listens there: it may read `/v1/status` and write rules. Its requests still name
//! `evil.example` in `Host`, so a listener bound to loopback answers only loopback Hosts. A page
//! that posts to `http://127.0.0.1:9791` from elsewhere cannot read the answer, but a write needs no
//! answer: browsers send `Origin` on such requests, so a write with a foreign one is refused, and
//! a form (the one cross-site write that needs no CORS preflight) cannot send
//! `Content-Type: application/json`, so where bodies are JSON nothing else is taken.

use std::net::{IpAddr, Ipv6Addr};

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::Router;

/// What a listener asks of requests before they reach its routes.
#[derive(Debug, Clone, Copy)]
pub struct BrowserGuard {
    /// Only requests whose `Host` names loopback (`localhost`, 127.0.0.0/8, `[::1]`, any port):
    /// for a listener bound to loopback, where any other name is a rebinding page. (A listener
    /// bound beyond loopback is reached by names the agent cannot know: Prometheus asks for
    /// `agent-1:9790`.)
    pub loopback_host: bool,
    /// PUT and POST must carry `Content-Type: application/json` (the rules API, whose bodies are).
    pub json_bodies: bool,
}

impl BrowserGuard {
    /// `app` behind this guard.
    pub fn layer(self, app: Router) -> Router {
        app.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| async move {
                match self.refusal(
                    req.method(),
                    req.headers(),
                    req.uri().authority().map(|a| a.as_str()),
                ) {
                    Some((status, message)) => {
                        (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
                    }
                    None => next.run(req).await,
                }
            },
        ))
    }

    /// Why a request is refused, if it is. `authority` is the request target's, for the rare
    /// request in absolute form (`GET http://host/ …`).
    fn refusal(
        &self,
        method: &Method,
        headers: &HeaderMap,
        authority: Option<&str>,
    ) -> Option<(StatusCode, String)> {
        let host = headers
            .get(header::HOST)
            .map(|h| h.to_str().unwrap_or("\u{fffd}"))
            .or(authority);
        if self.loopback_host {
            // No Host at all is a hand-made HTTP/1.0 request, never a browser's.
            if let Some(host) = host.filter(|h| !loopback_authority(h)) {
                return Some((
                    StatusCode::FORBIDDEN,
                    format!(
                        "this API answers requests for localhost, 127.0.0.1 or [::1] only, not Host {host:?}: a web page must not reach it under a name of its own (DNS rebinding)"
                    ),
                ));
            }
        }
        if !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
            if let Some(origin) = headers.get(header::ORIGIN) {
                let origin = origin.to_str().unwrap_or("\u{fffd}");
                let site = origin
                    .strip_prefix("http://")
                    .or_else(|| origin.strip_prefix("https://"));
                let allowed = site.is_some_and(|s| {
                    loopback_authority(s) || host.is_some_and(|h| h.eq_ignore_ascii_case(s))
                });
                if !allowed {
                    return Some((
                        StatusCode::FORBIDDEN,
                        format!(
                            "a request from another site (Origin {origin:?}) may not change this API; send it from this host without an Origin, or from a loopback one"
                        ),
                    ));
                }
            }
            if self.json_bodies && matches!(*method, Method::PUT | Method::POST) && !json(headers) {
                return Some((
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "send the body as JSON, with Content-Type: application/json".into(),
                ));
            }
        }
        None
    }
}

/// Whether `Content-Type` is `application/json` (parameters such as `charset` allowed).
fn json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// Whether `host[:port]` names loopback: `localhost`, an address of 127.0.0.0/8, `[::1]`.
fn loopback_authority(authority: &str) -> bool {
    let host = match authority.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((v6, rest)) if rest.is_empty() || rest.strip_prefix(':').is_some_and(is_port) => {
                return v6
                    .parse::<Ipv6Addr>()
                    .is_ok_and(|a| IpAddr::V6(a).to_canonical().is_loopback());
            }
            _ => return false,
        },
        None => match authority.rsplit_once(':') {
            Some((host, port)) if is_port(port) => host,
            Some(_) => return false,
            None => authority,
        },
    };
    let host = host.strip_suffix('.').unwrap_or(host);
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

/// A port number: 1 to 5 digits.
fn is_port(p: &str) -> bool {
    !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_addresses_with_any_port() {
        for ok in [
            "localhost",
            "LOCALHOST:9791",
            "localhost.:80",
            "127.0.0.1",
            "127.0.0.1:9790",
            "127.9.8.7:1",
            "[::1]",
            "[::1]:9791",
            "[::ffff:127.0.0.1]:9791",
        ] {
            assert!(loopback_authority(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:9791",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "10.0.0.1:9790",
            "0.0.0.0:9790",
            "[::2]:1",
            "[::1",
            "[::1]x",
            "127.0.0.1:port",
            "2130706433",
            "",
        ] {
            assert!(!loopback_authority(bad), "{bad}");
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn rebinding_cross_site_writes_and_forms_are_refused() {
        let guard = BrowserGuard {
            loopback_host: true,
            json_bodies: true,
        };
        let status = |m: Method, h: &[(&'static str, &str)]| {
            guard
                .refusal(&m, &headers(h), None)
                .map_or(StatusCode::OK, |(s, _)| s)
        };
        let json = ("content-type", "application/json; charset=utf-8");
        let local = ("host", "127.0.0.1:9791");
        assert_eq!(status(Method::GET, &[local]), StatusCode::OK);
        assert_eq!(status(Method::GET, &[]), StatusCode::OK, "no Host: not a browser");
        assert_eq!(
            status(Method::GET, &[("host", "evil.example:9791")]),
            StatusCode::FORBIDDEN
        );
        assert_eq!(status(Method::PUT, &[local, json]), StatusCode::OK);
        assert_eq!(
            status(Method::PUT, &[local, json, ("origin", "http://localhost:3000")]),
            StatusCode::OK
        );
        for origin in ["http://evil.example", "null", "https://127.0.0.1.evil.example"] {
            assert_eq!(
                status(Method::POST, &[local, json, ("origin", origin)]),
                StatusCode::FORBIDDEN,
                "{origin}"
            );
        }
        assert_eq!(
            status(Method::DELETE, &[local, ("origin", "http://evil.example")]),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            status(Method::GET, &[local, ("origin", "http://evil.example")]),
            StatusCode::OK,
            "a read from elsewhere gets no CORS header: the page cannot see the answer"
        );
        for form in [
            "application/x-www-form-urlencoded",
            "text/plain",
            "multipart/form-data",
        ] {
            assert_eq!(
                status(Method::POST, &[local, ("content-type", form)]),
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "{form}"
            );
        }
        assert_eq!(status(Method::PUT, &[local]), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(status(Method::DELETE, &[local]), StatusCode::OK);
    }

    #[test]
    fn beyond_loopback_any_host_and_its_own_origin_pass() {
        let guard = BrowserGuard {
            loopback_host: false,
            json_bodies: false,
        };
        let h = |pairs: &[(&'static str, &str)]| guard.refusal(&Method::PUT, &headers(pairs), None);
        assert!(h(&[("host", "agent-1:9790")]).is_none());
        assert!(h(&[("host", "agent-1:9790"), ("origin", "http://agent-1:9790")]).is_none());
        assert!(h(&[("host", "agent-1:9790"), ("origin", "http://evil.example")]).is_some());
        assert!(h(&[("host", "agent-1:9790"), ("content-type", "text/plain")]).is_none());
    }
}
