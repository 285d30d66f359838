//! TLS on the gRPC listener (`--grpc-tls-cert`, `--grpc-tls-key`, `--grpc-tls-client-ca`): a client
//! trusting the listener's CA is answered over TLS with ALPN `h2` (the `h2` crate's client, over
//! tokio-rustls), a cleartext one is not; with a client CA, only a client with a certificate it
//! signed is; and a certificate replaced on disk is served after SIGHUP without a restart.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use floodgate_agent::envoy::proto::RateLimitResponse;
use floodgate_tests::raw_h2::{grpc_message, request, Raw, PATH};
use floodgate_tests::{eventually, Agent, TestCa};
use prost::Message;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

const RULES: &str = r#"{"rules":[
  {"id":"edge-ip","dimension":"descriptor","limit":1000,"windowSeconds":60,
   "envoy":{"domain":"edge","descriptors":[{"key":"remote_address"}]}}]}"#;

/// A CA, a server certificate it signed for 127.0.0.1 and localhost, and a client certificate
/// (`server.pem`/`.key`, `client.pem`/`.key`).
fn make_pki(name: &str) -> TestCa {
    let ca = TestCa::new(name);
    ca.issue("server", &["127.0.0.1", "localhost"]);
    ca.issue("client", &["envoy"]);
    ca
}

async fn agent(server: &TestCa, client_ca: Option<&TestCa>) -> Agent {
    let mut b = Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .arg("--grpc-tls-cert")
        .arg(&server.path("server.pem"))
        .arg("--grpc-tls-key")
        .arg(&server.path("server.key"));
    if let Some(ca) = client_ca {
        b = b.arg("--grpc-tls-client-ca").arg(&ca.path("ca.pem"));
    }
    b.start().await
}

/// One ShouldRateLimit call over TLS trusting `trust`'s CA, presenting `identity`'s client
/// certificate if given: the status's limit_remaining, or why it failed.
async fn call(agent: &Agent, trust: &TestCa, identity: Option<&TestCa>) -> Result<u32, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(trust.path("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(id.path("client.pem"))
                    .unwrap()
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_file(id.path("client.key")).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (mut h2, conn) = h2::client::handshake(tls).await.map_err(|e| format!("h2: {e}"))?;
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method("POST")
        .uri(format!("https://localhost{PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut send) = h2.send_request(req, false).map_err(|e| format!("request: {e}"))?;
    send.send_data(Bytes::from(grpc_message(&request("203.0.113.50"))), true)
        .map_err(|e| e.to_string())?;
    let response = response.await.map_err(|e| format!("response: {e}"))?;
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        bytes.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
    }
    let trailers = body
        .trailers()
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    if trailers.get("grpc-status").map(|v| v.as_bytes()) != Some(b"0") {
        return Err(format!("grpc-status {:?}", trailers.get("grpc-status")));
    }
    let m = RateLimitResponse::decode(&bytes[5..]).map_err(|e| e.to_string())?;
    Ok(m.statuses[0].limit_remaining)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_is_answered_and_a_cleartext_one_is_not() {
    let pki = make_pki("grpc test CA");
    let agent = agent(&pki, None).await;
    assert_eq!(call(&agent, &pki, None).await, Ok(999));
    assert_eq!(call(&agent, &pki, None).await, Ok(998));
    // Cleartext HTTP/2 to a TLS listener: no SETTINGS, the connection closed.
    let mut plain = Raw::open(&agent, &[]).await;
    assert!(plain.next().await.is_none());
    // A client trusting another CA refuses the agent's certificate.
    let other = make_pki("another CA");
    assert!(call(&agent, &other, None)
        .await
        .unwrap_err()
        .contains("handshake"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_a_client_it_signed_is_answered() {
    let pki = make_pki("grpc test CA");
    let agent = agent(&pki, Some(&pki)).await;
    assert!(call(&agent, &pki, None).await.is_err(), "no client certificate");
    let stranger = make_pki("a stranger's CA");
    assert!(
        call(&agent, &pki, Some(&stranger)).await.is_err(),
        "a certificate of another CA"
    );
    assert_eq!(call(&agent, &pki, Some(&pki)).await, Ok(999));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_is_served_after_sighup() {
    let first = make_pki("first CA");
    let agent = agent(&first, None).await;
    assert_eq!(call(&agent, &first, None).await, Ok(999));
    // The files replaced by a certificate of another CA, then SIGHUP.
    let second = make_pki("second CA");
    for f in ["server.pem", "server.key"] {
        std::fs::copy(second.path(f), first.path(f)).unwrap();
    }
    floodgate_tests::signal(agent.pid().unwrap(), 1);
    eventually(
        "the new certificate is served",
        Duration::from_secs(10),
        || async { call(&agent, &second, None).await.ok() },
    )
    .await;
    assert!(
        call(&agent, &first, None).await.is_err(),
        "the old CA no longer verifies it"
    );
}
