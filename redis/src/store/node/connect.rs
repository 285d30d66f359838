//! Where a node is (from its URL) and a connection to it: TCP, TLS or a Unix socket, signed in with
//! AUTH and SELECT and checked with a PING, within [`CONNECT_TIMEOUT`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use floodgate_core::store::StoreError;

use crate::shards::RedisAccess;
use crate::store::resp::{self, Reply, RespError};

/// Longest a connect (TCP, TLS, AUTH, SELECT) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Where a node is and how to sign in, from its URL.
pub struct NodeAddr {
    target: Target,
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

enum Target {
    Tcp(String, u16),
    Unix(PathBuf),
}

/// A connection: TCP, TLS over TCP, or a Unix socket.
pub(super) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

impl NodeAddr {
    /// The node behind `url`; `None` for a URL whose checks stay with redis-rs (`rediss://…#insecure`:
    /// TLS without checking the certificate's name is not built here). One such URL keeps every
    /// node's checks with redis-rs.
    pub fn new(url: &str, access: &RedisAccess) -> Result<Option<NodeAddr>, StoreError> {
        let err = |e: String| StoreError::Connection(format!("{}: {e}", floodgate_core::store::redact(url)));
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| err(e.to_string()))?;
        let settings = info.redis_settings();
        let (target, tls) = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => (Target::Tcp(host.clone(), *port), None),
            redis::ConnectionAddr::TcpTls { insecure: true, .. } => return Ok(None),
            redis::ConnectionAddr::TcpTls { host, port, .. } => {
                let name = ServerName::try_from(host.clone()).map_err(|e| err(e.to_string()))?;
                let roots = roots(access.ca.as_deref()).map_err(err)?;
                let config = rustls::ClientConfig::builder()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                (Target::Tcp(host.clone(), *port), Some((Arc::new(config), name)))
            }
            redis::ConnectionAddr::Unix(path) => (Target::Unix(path.clone()), None),
            // A kind of address a later redis-rs may add.
            _ => return Ok(None),
        };
        Ok(Some(NodeAddr {
            target,
            tls,
            username: settings.username().map(str::to_string),
            password: access
                .password
                .clone()
                .or_else(|| settings.password().map(str::to_string)),
            db: settings.db(),
        }))
    }

    /// The node's host and port (a Unix socket: its path, no port), for traces.
    pub fn server(&self) -> (String, Option<u16>) {
        match &self.target {
            Target::Tcp(host, port) => (host.clone(), Some(*port)),
            Target::Unix(path) => (path.display().to_string(), None),
        }
    }

    /// Connects and signs in (AUTH, SELECT).
    pub(super) async fn connect(&self) -> Result<Box<dyn Io>, StoreError> {
        let io_err = |e: std::io::Error| StoreError::Connection(e.to_string());
        let mut io: Box<dyn Io> = match &self.target {
            Target::Tcp(host, port) => {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(io_err)?;
                tcp.set_nodelay(true).map_err(io_err)?;
                match &self.tls {
                    Some((config, name)) => Box::new(
                        tokio_rustls::TlsConnector::from(config.clone())
                            .connect(name.clone(), tcp)
                            .await
                            .map_err(io_err)?,
                    ),
                    None => Box::new(tcp),
                }
            }
            Target::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await.map_err(io_err)?),
        };
        // One command at a time: AUTH (Redis 5 and older know no user name: without it, as redis-rs
        // does), SELECT, and always a PING, so that a Redis that accepts and then refuses (maxclients,
        // protected mode, still loading) is a failed connect, with its backoff, not a connection that
        // fails its first call.
        if let Some(password) = &self.password {
            let pass = password.as_bytes();
            let mut refused = match &self.username {
                Some(user) => sign_in(&mut io, &[b"AUTH", user.as_bytes(), pass]).await?,
                None => sign_in(&mut io, &[b"AUTH", pass]).await?,
            };
            if self.username.is_some()
                && refused
                    .as_deref()
                    .is_some_and(|e| e.contains("wrong number of arguments"))
            {
                refused = sign_in(&mut io, &[b"AUTH", pass]).await?;
            }
            if let Some(e) = refused {
                return Err(StoreError::Connection(format!("Redis refused the sign-in: {e}")));
            }
        }
        if self.db != 0 {
            if let Some(e) = sign_in(&mut io, &[b"SELECT", self.db.to_string().as_bytes()]).await? {
                return Err(StoreError::Connection(format!(
                    "Redis refused SELECT {}: {e}",
                    self.db
                )));
            }
        }
        if let Some(e) = sign_in(&mut io, &[b"PING"]).await? {
            return Err(StoreError::Connection(format!("Redis refused PING: {e}")));
        }
        Ok(io)
    }
}

/// Sends one command of the sign-in and reads its reply: `Some(error text)` if Redis refused it.
async fn sign_in(io: &mut Box<dyn Io>, args: &[&[u8]]) -> Result<Option<String>, StoreError> {
    let io_err = |e: std::io::Error| StoreError::Connection(e.to_string());
    let mut out = Vec::new();
    resp::command(&mut out, args);
    io.write_all(&out).await.map_err(io_err)?;
    io.flush().await.map_err(io_err)?;
    let mut buf = Vec::with_capacity(128);
    loop {
        match resp::parse(&buf) {
            Ok((Reply::Error(e), _)) => return Ok(Some(e)),
            Ok(_) => return Ok(None),
            Err(RespError::Incomplete) => {
                if io.read_buf(&mut buf).await.map_err(io_err)? == 0 {
                    return Err(StoreError::Connection("Redis closed the connection".into()));
                }
            }
            Err(e) => return Err(StoreError::Connection(e.to_string())),
        }
    }
}

/// The roots a `rediss://` connection trusts: the `--redis-ca` certificates only, or the system's.
fn roots(ca: Option<&[u8]>) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("the Redis CA is not PEM certificates: {e}"))?;
                roots.add(cert).map_err(|e| format!("the Redis CA: {e}"))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    Ok(roots)
}
