//! What the server reads of a request's header block, field by field as HPACK hands them over, and
//! whether the block is a well-formed request (RFC 9113 §8.1.1: a malformed one is a stream error
//! of type PROTOCOL_ERROR).
//!
//! Values are compared in the form they were sent (a Huffman code against the constant's code), so
//! a header the server does not read costs no decoding.

use crate::grpc;
use crate::hpack::Value;
use crate::service::Config;

/// Which method a request's `:path` names.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    /// None this server has.
    #[default]
    Other,
    /// The service's method of this index in [`Config`].
    Call(usize),
    /// grpc.health.v1 Check.
    HealthCheck,
    /// grpc.health.v1 Watch (refused: probes poll Check).
    HealthWatch,
}

/// The pseudo-header fields a request must carry, as bits.
const METHOD: u8 = 1;
const SCHEME: u8 = 2;
const PATH: u8 = 4;
const AUTHORITY: u8 = 8;

/// A request's header block as far as the server reads it.
#[derive(Debug, Default, Clone)]
pub(crate) struct RequestHead {
    pub post: bool,
    pub method: Method,
    pub grpc: bool,
    /// The caller's `traceparent`, read only when the service asks for it.
    pub trace: Option<Box<[u8]>>,
    /// The request's `content-length`, if it gave one: its DATA must add up to it.
    pub content_length: Option<u64>,
    /// Pseudo-header fields seen (bits).
    pseudo: u8,
    /// A regular field seen (pseudo-header fields must all come before).
    regular: bool,
    /// Why the block is malformed, at its first fault.
    malformed: Option<&'static str>,
}

impl RequestHead {
    /// One field of the block (`upper`: its name has an upper-case letter, as HPACK found).
    pub fn field(
        &mut self,
        name: &[u8],
        value: Value<'_>,
        upper: bool,
        buf: &mut Vec<u8>,
        config: &Config,
        trace: bool,
    ) {
        if name.first() == Some(&b':') {
            let bit = match name {
                b":method" => METHOD,
                b":scheme" => SCHEME,
                b":path" => PATH,
                b":authority" => AUTHORITY,
                _ => return self.fault("an unknown pseudo-header field"),
            };
            if self.regular {
                return self.fault("a pseudo-header field after a regular one");
            }
            if self.pseudo & bit != 0 {
                return self.fault("a pseudo-header field twice");
            }
            self.pseudo |= bit;
            match bit {
                METHOD => self.post = value.is(b"POST", &coded().post),
                PATH if value.sent_len() == 0 => self.fault("an empty :path"),
                PATH => self.method = method(config, &value),
                _ => {}
            }
            return;
        }
        self.regular = true;
        match name {
            b"content-type" => {
                self.grpc = value
                    .bytes(buf)
                    .is_some_and(|v| v.starts_with(b"application/grpc"))
            }
            b"traceparent" if trace => self.trace = value.bytes(buf).map(Box::from),
            b"te" if !value.is(b"trailers", &coded().trailers) => {
                self.fault("a te field other than trailers")
            }
            b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding" | b"upgrade" => {
                self.fault("a connection-specific field")
            }
            b"content-length" => {
                match value
                    .bytes(buf)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse().ok())
                {
                    Some(n) if self.content_length.is_none_or(|m| m == n) => self.content_length = Some(n),
                    _ => self.fault("a content-length that is not one number"),
                }
            }
            _ if upper => self.fault("an upper-case field name"),
            _ => {}
        }
    }

    fn fault(&mut self, why: &'static str) {
        self.malformed.get_or_insert(why);
    }

    /// Why the block is not a well-formed request's headers, if it is not.
    pub fn request_fault(&self) -> Option<&'static str> {
        self.malformed.or_else(|| {
            (self.pseudo & (METHOD | SCHEME | PATH) != METHOD | SCHEME | PATH)
                .then_some("a request without :method, :scheme or :path")
        })
    }

    /// Why the block is not well-formed trailers (no pseudo-header fields), if it is not.
    pub fn trailers_fault(&self) -> Option<&'static str> {
        self.malformed
            .or_else(|| (self.pseudo != 0).then_some("a pseudo-header field in trailers"))
    }
}

/// The method a `:path` names.
fn method(config: &Config, value: &Value<'_>) -> Method {
    let c = coded();
    if let Some(m) = config.method(value) {
        Method::Call(m)
    } else if value.is(grpc::HEALTH_CHECK, &c.health_check) {
        Method::HealthCheck
    } else if value.is(grpc::HEALTH_WATCH, &c.health_watch) {
        Method::HealthWatch
    } else {
        Method::Other
    }
}

/// The Huffman codes of the values compared.
struct Coded {
    post: Vec<u8>,
    trailers: Vec<u8>,
    health_check: Vec<u8>,
    health_watch: Vec<u8>,
}

fn coded() -> &'static Coded {
    static CODED: std::sync::OnceLock<Coded> = std::sync::OnceLock::new();
    CODED.get_or_init(|| Coded {
        post: crate::huffman::encode(b"POST"),
        trailers: crate::huffman::encode(b"trailers"),
        health_check: crate::huffman::encode(grpc::HEALTH_CHECK),
        health_watch: crate::huffman::encode(grpc::HEALTH_WATCH),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(fields: &[(&str, &str)]) -> RequestHead {
        let config = Config::new(&[b"/a.B/C"], &[]);
        let mut h = RequestHead::default();
        let mut buf = Vec::new();
        for (n, v) in fields {
            let upper = n.bytes().any(|b| b.is_ascii_uppercase());
            h.field(
                n.as_bytes(),
                Value::Plain(v.as_bytes()),
                upper,
                &mut buf,
                &config,
                false,
            );
        }
        h
    }

    const OK: [(&str, &str); 4] = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/a.B/C"),
        ("content-type", "application/grpc"),
    ];

    #[test]
    fn a_grpc_request_is_well_formed() {
        let h = head(&OK);
        assert_eq!(h.request_fault(), None);
        assert!(h.post && h.grpc);
        assert_eq!(h.method, Method::Call(0));
        assert_eq!(head(&[("grpc-status", "0")]).trailers_fault(), None);
    }

    #[test]
    fn each_malformed_request_names_its_fault() {
        let with = |extra: (&'static str, &'static str)| {
            let mut f = OK.to_vec();
            f.push(extra);
            head(&f).request_fault()
        };
        assert_eq!(
            with((":method", "GET")),
            Some("a pseudo-header field after a regular one")
        );
        assert_eq!(with((":status", "200")), Some("an unknown pseudo-header field"));
        assert_eq!(with(("te", "gzip")), Some("a te field other than trailers"));
        assert_eq!(with(("te", "trailers")), None);
        assert_eq!(with(("connection", "close")), Some("a connection-specific field"));
        assert_eq!(with(("X-Upper", "1")), Some("an upper-case field name"));
        assert_eq!(
            with(("content-length", "x")),
            Some("a content-length that is not one number")
        );
        assert_eq!(
            head(&OK[1..]).request_fault(),
            Some("a request without :method, :scheme or :path")
        );
        assert_eq!(
            head(&[(":method", "POST"), (":method", "POST")]).request_fault(),
            Some("a pseudo-header field twice")
        );
        assert_eq!(head(&[(":path", "")]).request_fault(), Some("an empty :path"));
        assert_eq!(
            head(&[(":path", "/")]).trailers_fault(),
            Some("a pseudo-header field in trailers")
        );
    }
}
