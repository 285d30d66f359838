//! The rules service's HTTP client (the agent's follower and the `floodgate rules` CLI): reqwest
//! over rustls, `http://` or `https://`, trusting the system's roots plus an optional private CA
//! (`--rules-ca`); and the TLS settings the rules service serves with.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// A response: status, headers (lower-case names) and body.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

static CLIENT: OnceLock<Result<reqwest::Client, String>> = OnceLock::new();

/// Makes rustls use ring (once per process).
pub fn tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Why certificates or the client's TLS could not be set up: the message names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TlsSetupError(pub String);

/// PEM certificates from a file, for a root store.
pub fn pem_certs(pem: &[u8]) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, TlsSetupError> {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsSetupError(format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(TlsSetupError("no certificate in the PEM file".into()));
    }
    Ok(certs)
}

/// Sets the roots the client trusts: the system's, plus the PEM certificates of `ca` (a private
/// CA). Call before the first request; later calls change nothing.
pub fn configure(ca: Option<&std::path::Path>) -> Result<(), TlsSetupError> {
    let built = build(ca);
    let ok = built.as_ref().map(|_| ()).map_err(|e| TlsSetupError(e.clone()));
    let _ = CLIENT.set(built);
    ok
}

fn build(ca: Option<&std::path::Path>) -> Result<reqwest::Client, String> {
    tls_provider();
    let mut roots = rustls::RootCertStore::empty();
    // The system's store (a missing or partly unreadable one still leaves the private CA).
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca {
        let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        for cert in pem_certs(&pem).map_err(|e| format!("{}: {e}", path.display()))? {
            roots.add(cert).map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .connect_timeout(Duration::from_secs(5))
        // The rules service closes a connection idle for its header timeout (5 s by default), and
        // an agent reports dry runs every 5 s: reusing a connection idle that long would meet the
        // close, a few milliseconds either way. Past 4 s idle a new connection is made instead.
        .pool_idle_timeout(POOL_IDLE)
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// How long a pooled connection may wait idle before the client drops it: under the services'
/// keep-alive idle timeout, `listen::DEFAULT_HEADER_TIMEOUT_MS`.
const POOL_IDLE: Duration = Duration::from_secs(4);
const _: () = assert!(POOL_IDLE.as_secs() * 1_000 < crate::listen::DEFAULT_HEADER_TIMEOUT_MS);

/// The process's HTTP client (the system's roots and `--rules-ca`'s), for another use than the rules
/// service: the span exporter's OTLP/HTTP posts.
pub fn shared_client() -> Result<reqwest::Client, String> {
    client().cloned()
}

/// A client of its own trusting the system's roots and the PEM certificates of `ca` (the span
/// exporter's `OTEL_EXPORTER_OTLP_CERTIFICATE`).
pub fn client_with_ca(ca: &std::path::Path) -> Result<reqwest::Client, String> {
    build(Some(ca))
}

fn client() -> Result<&'static reqwest::Client, String> {
    CLIENT.get_or_init(|| build(None)).as_ref().map_err(Clone::clone)
}

/// The largest answer read from the rules service: 32 MiB, a set of ~100,000 rules of the few
/// hundred bytes each takes. Past it the answer is refused and the set in force stays.
pub const MAX_ANSWER: usize = 32 << 20;

fn too_large(method: &str, base: &str, path: &str) -> String {
    format!(
        "{method} {base}{path}: the answer is over {} MiB; refused",
        MAX_ANSWER >> 20
    )
}

/// Sends one request to `base` (`http://host:port` or `https://host:port`) and reads the whole
/// response (any framing: length, chunked), within `timeout`.
pub async fn request(
    base: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    extra: &[(&str, String)],
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response, String> {
    let base = base.trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(format!(
            "{base:?}: the rules service is http://host:port or https://host:port"
        ));
    }
    let method_v = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
    let mut rb = client()?
        .request(method_v, format!("{base}{path}"))
        .timeout(timeout);
    if let Some(t) = token {
        rb = rb.bearer_auth(t);
    }
    for (k, v) in extra {
        rb = rb.header(*k, v);
    }
    let body = body.unwrap_or_default();
    if !body.is_empty() || method == "PUT" || method == "POST" {
        // JSON unless the caller named its body's type (an OTLP/protobuf export).
        if !extra.iter().any(|(k, _)| k.eq_ignore_ascii_case("content-type")) {
            rb = rb.header("content-type", "application/json");
        }
        rb = rb.body(body.to_vec());
    }
    let what = |e: reqwest::Error| {
        if e.is_timeout() {
            format!("{method} {base}{path}: no answer within {timeout:?}")
        } else {
            format!("{method} {base}{path}: {e}")
        }
    };
    let r = rb.send().await.map_err(what)?;
    let status = r.status().as_u16();
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    // Read in chunks up to the bound: a hostile or mistaken service that answers 3 GiB must not
    // grow the agent to match (it did, to 4.1 GiB).
    if r.content_length().is_some_and(|n| n > MAX_ANSWER as u64) {
        return Err(too_large(method, base, path));
    }
    let mut r = r;
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(what)? {
        if body.len() + chunk.len() > MAX_ANSWER {
            return Err(too_large(method, base, path));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// The rules service's TLS: its certificate chain and key (PEM files).
pub fn server_tls(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    tls_provider();
    let read =
        |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    let chain = pem_certs(&read(cert)?).map_err(|e| format!("{}: {e}", cert.display()))?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&read(key)?)
        .map_err(|e| format!("{}: not a PEM private key: {e}", key.display()))?;
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("the certificate and key do not fit: {e}"))?;
    Ok(Arc::new(config))
}
