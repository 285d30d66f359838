//! TLS on the gRPC TCP listener (`--grpc-tls-cert`, `--grpc-tls-key`, optionally
//! `--grpc-tls-client-ca` to require client certificates): rustls with ALPN `h2`, the files read
//! again on SIGHUP so a renewed certificate needs no restart (a new connection gets it; open ones
//! keep theirs). A handshake not done within the frame timeout closes the connection.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// Where the listener's certificate, key and client CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain (PEM), the server's first.
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates (PEM) a client's certificate must chain to; none: clients present none.
    pub client_ca: Option<PathBuf>,
}

/// The listener's TLS, reloadable.
pub struct GrpcTls {
    files: TlsFiles,
    acceptor: RwLock<TlsAcceptor>,
}

impl GrpcTls {
    /// Reads the files; an error names the file and what is wrong with it.
    pub fn load(files: TlsFiles) -> anyhow::Result<Self> {
        let acceptor = RwLock::new(acceptor(&files)?);
        Ok(GrpcTls { files, acceptor })
    }

    /// Reads the files again; on an error the running certificate stays.
    pub fn reload(&self) -> anyhow::Result<()> {
        let next = acceptor(&self.files)?;
        *self.acceptor.write().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(())
    }

    /// The acceptor new connections use.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.acceptor.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: not PEM certificates", path.display()))?;
    anyhow::ensure!(!certs.is_empty(), "{}: no certificate in it", path.display());
    Ok(certs)
}

fn acceptor(files: &TlsFiles) -> anyhow::Result<TlsAcceptor> {
    // rustls with ring (once per process; the Redis client installs the same).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let chain = certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .with_context(|| format!("{}: no PEM private key in it", files.key.display()))?;
    let builder = ServerConfig::builder();
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca)? {
                roots
                    .add(c)
                    .with_context(|| format!("{}: a CA certificate rustls refuses", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .with_context(|| format!("{}: no usable CA", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).with_context(|| {
        format!(
            "{} and {} do not make a certificate and its key",
            files.cert.display(),
            files.key.display()
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
