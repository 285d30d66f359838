//! What a client's handles and its connection task share: the configuration, the calls waiting
//! for answers, the link's history, the counters, and the agent's fail-mode list.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use floodgate_protocol::{Decision, ErrorBody, FailModeList};
use tokio::sync::oneshot;

use crate::config::{ClientConfig, FailPolicy};
use crate::socket::default_socket_path;

/// An agent's answer to one request.
pub(crate) enum Reply {
    Decision(Decision),
    Error(ErrorBody),
}

/// The link's history: what [`Health`] reports, and the rate limit of its warnings.
#[derive(Debug, Default)]
pub(crate) struct Link {
    pub(crate) path: PathBuf,
    pub(crate) last_error: Option<String>,
    pub(crate) failed_attempts: u64,
    /// When the last warning was logged, and failed attempts since then not logged.
    last_warn: Option<Instant>,
    unlogged: u64,
    /// Whether this outage was warned about (then its end is said too).
    warned: bool,
}

/// At most one warning per client this often: an app whose agent is gone makes an attempt every
/// second at the backoff's top, and hundreds of clients would flood its logs.
const WARN_EVERY: Duration = Duration::from_secs(10);

pub(crate) struct Shared {
    /// The socket given by the caller; none: [`default_socket_path`] on every attempt.
    pub(crate) path: Option<PathBuf>,
    pub(crate) link: Mutex<Link>,
    pub(crate) config: ClientConfig,
    pub(crate) pending: Mutex<HashMap<u32, oneshot::Sender<Reply>>>,
    pub(crate) connected: AtomicBool,
    /// The protocol version of the live connection (0 before the first).
    pub(crate) version: AtomicU8,
    pub(crate) connects: AtomicU64,
    pub(crate) unavailable: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) local_denied: AtomicU64,
    /// The per-process fallback limit's buckets.
    pub(crate) local: Mutex<HashMap<String, (f64, Instant)>>,
    next_id: AtomicU32,
    /// Lease ids: a sequence hashed under this process's random keys.
    leases: (std::collections::hash_map::RandomState, AtomicU64),
    /// The agent's last fail-mode list, kept while the agent is away: the rules that deny then.
    fail_modes: Mutex<Option<Arc<FailModeList>>>,
}

impl Shared {
    /// The state of a new client of the agent at `path` (none: the default socket, looked up on
    /// every attempt).
    pub(crate) fn new(path: Option<PathBuf>, config: ClientConfig) -> Self {
        Shared {
            link: Mutex::new(Link {
                path: path.clone().unwrap_or_else(default_socket_path),
                ..Link::default()
            }),
            path,
            config,
            pending: Mutex::new(HashMap::new()),
            connected: AtomicBool::new(false),
            version: AtomicU8::new(0),
            connects: AtomicU64::new(0),
            unavailable: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            local_denied: AtomicU64::new(0),
            local: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(1),
            leases: (Default::default(), AtomicU64::new(0)),
            fail_modes: Mutex::new(None),
        }
    }

    /// A new lease id: 64 bits no other client picks (SipHash of a sequence under random keys).
    pub(crate) fn next_lease(&self) -> u64 {
        use std::hash::BuildHasher;
        let n = self.leases.1.fetch_add(1, Ordering::Relaxed);
        self.leases.0.hash_one(n).max(1)
    }

    /// The socket to try now.
    pub(crate) fn target(&self) -> PathBuf {
        self.path.clone().unwrap_or_else(default_socket_path)
    }

    pub(crate) fn link(&self) -> std::sync::MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection attempt to `path` failed: recorded, and warned about at most every
    /// [`WARN_EVERY`] (the next warning counts the attempts not logged).
    pub(crate) fn link_failed(&self, path: &Path, error: String) {
        let mut l = self.link();
        l.path = path.to_path_buf();
        l.failed_attempts += 1;
        let now = Instant::now();
        if l.last_warn.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            l.unlogged += 1;
            l.last_error = Some(error);
            return;
        }
        let policy = match self.config.fail {
            FailPolicy::Open => "open",
            FailPolicy::Closed => "closed",
        };
        let unlogged = match std::mem::take(&mut l.unlogged) {
            0 => String::new(),
            n => format!(" ({n} more failed attempts not logged since the last warning)"),
        };
        tracing::warn!(
            "floodgate: cannot reach the agent at {}: {error}; answering by fail policy {policy}{unlogged}",
            path.display()
        );
        l.last_warn = Some(now);
        l.warned = true;
        l.last_error = Some(error);
    }

    /// Connected to `path`: the outage, if one was warned about, is said to be over.
    pub(crate) fn link_up(&self, path: &Path) {
        let mut l = self.link();
        if l.warned {
            tracing::warn!(
                "floodgate: agent reachable again at {} (after {} failed attempts)",
                path.display(),
                l.failed_attempts
            );
        }
        *l = Link {
            path: path.to_path_buf(),
            ..Link::default()
        };
    }

    pub(crate) fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u32, oneshot::Sender<Reply>>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request id for a new request; never 0 (reserved for connection-level frames).
    pub(crate) fn next_id(&self) -> u32 {
        loop {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// The agent sent its fail-mode list: it replaces the last one whole.
    pub(crate) fn learn_fail_modes(&self, list: FailModeList) {
        if list.truncated {
            tracing::warn!(
                "floodgate: the agent lists more fail-closed rules than one frame holds; the {} listed \
                 deny while the agent is away, the rest follow the client's fail policy",
                list.rules.len()
            );
        }
        *self.fail_modes.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(list));
    }

    pub(crate) fn fail_modes(&self) -> Option<Arc<FailModeList>> {
        self.fail_modes.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
