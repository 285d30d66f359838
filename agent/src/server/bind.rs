//! Binding the agent's Unix socket safely: a stale socket replaced, a live agent's never taken over,
//! the file's mode set before any peer can connect.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::Path;

use tokio::net::UnixListener;

/// Binds the agent socket at `path` with file mode `mode`.
///
/// A socket file left by a crashed agent (nobody accepts on it) is replaced; a live agent's socket is
/// never taken over, and a path that is not a socket is never removed.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by a live agent", path.display()),
                ))
            }
            Err(_) => {
                tracing::info!(socket = %path.display(), "replacing a stale socket file");
                std::fs::remove_file(path)?;
            }
        }
    }
    // Bind inside a private (0700) directory next to the target, set the mode, then rename into place:
    // the socket appears at its path already with its final mode, so no peer can connect through a
    // wider umask-derived mode in between.
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = parent.join(format!(".floodgate-bind-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::DirBuilder::new().mode(0o700).create(&staging)?;
    let staged = staging.join("s");
    let result = (|| {
        let listener = UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&staged, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}
