//! Where the agent listens when nobody says: one default for the agent and every SDK (Rust, Python,
//! Node), never in world-writable `/tmp`, where any local user could bind the path first and answer
//! "allowed" to every check.

use std::path::{Path, PathBuf};

/// The agent's default socket: in `/run` (root-owned), a directory only the agent's user writes.
pub const DEFAULT_SOCKET: &str = "/run/floodgate/floodgate.sock";

/// The environment variable naming the agent's socket (or `tcp://host:port`), read by the agent and
/// every SDK.
pub const SOCKET_ENV: &str = "FLOODGATE_SOCKET";

/// The agent's socket for a client given no path, looked up on every connection attempt (an agent
/// started after the app is still found), in the same order as the Python and Node SDKs:
///
/// 1. `$FLOODGATE_SOCKET`, if set and not empty;
/// 2. else `/run/floodgate/floodgate.sock` if it exists (a system agent);
/// 3. else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock` if `XDG_RUNTIME_DIR` is absolute and that
///    file exists (an agent run by the user, as the README's first command does);
/// 4. else `/run/floodgate/floodgate.sock`, the path errors and logs name.
pub fn default_socket_path() -> PathBuf {
    if let Some(p) = std::env::var_os(SOCKET_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let system = Path::new(DEFAULT_SOCKET);
    if system.exists() {
        return system.to_path_buf();
    }
    match user_socket() {
        Some(user) if user.exists() => user,
        _ => system.to_path_buf(),
    }
}

/// `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`, when `XDG_RUNTIME_DIR` is set and absolute (a
/// relative one is invalid per the XDG spec, and would depend on the working directory).
pub fn user_socket() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("XDG_RUNTIME_DIR")?);
    dir.is_absolute()
        .then(|| dir.join("floodgate").join("floodgate.sock"))
}
