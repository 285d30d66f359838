//! The rules API's tokens and what each may do: `--token` (write), `--read-token` (read), a token
//! file of both kinds for `floodgate rules-server`, and the one-secret files agents and the CLI
//! read their token from (a secret in argv is in `ps` for every user of the host).

use std::path::{Path, PathBuf};

use axum::http::Method;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Read the rules (also watch them) and report dry runs: what an agent does.
    Read,
    /// Everything: write and delete rules, read the audit.
    Write,
}

impl Scope {
    /// Whether a token of this scope may make this request (`path` is the request's path). A read
    /// token may list, get and watch rules, read a dry run and report one
    /// (`POST /v1/rules/{id}/dry-run`, which agents do every 5 s).
    pub fn allows(self, method: &Method, path: &str) -> bool {
        if self == Scope::Write {
            return true;
        }
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let read = *method == Method::GET || *method == Method::HEAD;
        match parts.as_slice() {
            ["v1", "rules"] | ["v1", "rules", _] => read,
            ["v1", "rules", _, "overrides"] | ["v1", "rules", _, "overrides", _] => read,
            ["v1", "overrides"] | ["v1", "overrides", "audit"] => read,
            ["v1", "penalties"] | ["v1", "penalties", _] => read,
            ["v1", "rules", _, "dry-run"] => read || *method == Method::POST,
            _ => false,
        }
    }
}

/// A token: the name the audit records, the secret a request carries, and its scope.
#[derive(Clone)]
pub struct Token {
    /// Who (the audit's actor).
    pub name: String,
    /// The bearer secret.
    pub secret: String,
    /// What it may do.
    pub scope: Scope,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: a Debug print ends up in logs.
        f.debug_struct("Token")
            .field("name", &self.name)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Why tokens were refused; the service does not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// A flag's token is not `name:secret` (or a bare secret) with neither empty.
    #[error("a {flag} must be name:secret (or a secret) with neither empty, not {given:?}")]
    Flag {
        /// `--token` or `--read-token`.
        flag: &'static str,
        /// What was given.
        given: String,
    },
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A secrets file other users can read.
    #[error(
        "{} is readable by other users (mode {mode:04o}): its secrets are not; make it 0600 or 0400 (chmod go-rwx)",
        path.display()
    )]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A line of a token file that is not `write name:secret` or `read name:secret`.
    #[error("{} line {line}: {why}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// Its number, from 1.
        line: usize,
        /// What is wrong (never the line itself: it may hold a secret).
        why: &'static str,
    },
    /// A file that holds no token (a service given one would run without auth).
    #[error("{} holds no token", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// One secret given two scopes: which one a request gets would be an accident.
    #[error("tokens {read} (read) and {write} (write) have the same secret")]
    TwoScopes {
        /// The read token's name.
        read: String,
        /// The write token's name.
        write: String,
    },
}

/// A token given as a flag: `name:secret`, or a bare secret named `operator`.
pub fn from_flag(text: &str, scope: Scope) -> Result<Token, TokenError> {
    let (name, secret) = text.split_once(':').unwrap_or(("operator", text));
    if name.trim().is_empty() || secret.trim().is_empty() {
        return Err(TokenError::Flag {
            flag: match scope {
                Scope::Write => "--token",
                Scope::Read => "--read-token",
            },
            given: text.to_string(),
        });
    }
    Ok(Token {
        name: name.to_string(),
        secret: secret.to_string(),
        scope,
    })
}

/// The tokens of a token file: a line `write name:secret` or `read name:secret` each; blank lines
/// and `#` comments are skipped. Refused, naming the line, when one is anything else; refused when
/// other users may read the file (mode & 0o077) or when it holds no token.
pub fn from_file(path: &Path) -> Result<Vec<Token>, TokenError> {
    let text = read_private(path)?;
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why| TokenError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            why,
        };
        let (scope, rest) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| bad("expected `write name:secret` or `read name:secret`"))?;
        let scope = match scope {
            "write" => Scope::Write,
            "read" => Scope::Read,
            _ => return Err(bad("the scope must be `write` or `read`")),
        };
        let (name, secret) = rest
            .trim()
            .split_once(':')
            .ok_or_else(|| bad("expected name:secret after the scope"))?;
        if name.is_empty() || secret.is_empty() {
            return Err(bad("neither the name nor the secret may be empty"));
        }
        if name.contains(char::is_whitespace) || secret.contains(char::is_whitespace) {
            return Err(bad("a name or a secret has no spaces"));
        }
        tokens.push(Token {
            name: name.to_string(),
            secret: secret.to_string(),
            scope,
        });
    }
    if tokens.is_empty() {
        return Err(TokenError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(tokens)
}

/// Refuses a secret given both scopes.
pub fn check(tokens: &[Token]) -> Result<(), TokenError> {
    for r in tokens.iter().filter(|t| t.scope == Scope::Read) {
        if let Some(w) = tokens
            .iter()
            .find(|w| w.scope == Scope::Write && w.secret == r.secret)
        {
            return Err(TokenError::TwoScopes {
                read: r.name.clone(),
                write: w.name.clone(),
            });
        }
    }
    Ok(())
}

/// The secret of a one-secret file (an agent's or the CLI's token), trimmed.
pub fn secret_from_file(path: &Path) -> Result<String, TokenError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let secret = text.trim();
    if secret.is_empty() {
        return Err(TokenError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(secret.to_string())
}

/// A file's text, if no other user may read it.
fn read_private(path: &Path) -> Result<String, TokenError> {
    use std::os::unix::fs::PermissionsExt;
    let read = |source| TokenError::Read {
        path: path.to_path_buf(),
        source,
    };
    // The file a path names (a Kubernetes secret's path is a link into `..data/`).
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(TokenError::Exposed {
            path: path.to_path_buf(),
            mode,
        });
    }
    std::fs::read_to_string(path).map_err(read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(text: &str, mode: u32) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        (dir, path)
    }

    #[test]
    fn a_read_token_reads_and_reports_only() {
        let r = Scope::Read;
        assert!(r.allows(&Method::GET, "/v1/rules"));
        assert!(r.allows(&Method::GET, "/v1/rules/api"));
        assert!(r.allows(&Method::HEAD, "/v1/rules/api"));
        assert!(r.allows(&Method::GET, "/v1/rules/api/dry-run"));
        assert!(r.allows(&Method::POST, "/v1/rules/api/dry-run"));
        assert!(!r.allows(&Method::PUT, "/v1/rules/api"));
        assert!(!r.allows(&Method::DELETE, "/v1/rules/api"));
        assert!(!r.allows(&Method::POST, "/v1/rules/api"));
        assert!(!r.allows(&Method::GET, "/v1/audit"));
        assert!(Scope::Write.allows(&Method::DELETE, "/v1/rules/api"));
    }

    #[test]
    fn a_token_file_holds_both_scopes() {
        let (_d, path) = file(
            "# operators write, agents read\n\nwrite ops:s3cret\n  read agents:r34d  \n",
            0o600,
        );
        let tokens = from_file(&path).unwrap();
        let got: Vec<_> = tokens
            .iter()
            .map(|t| (t.name.as_str(), t.secret.as_str(), t.scope))
            .collect();
        assert_eq!(
            got,
            [("ops", "s3cret", Scope::Write), ("agents", "r34d", Scope::Read)]
        );
        assert!(!format!("{tokens:?}").contains("s3cret"), "Debug hides secrets");
    }

    #[test]
    fn a_bad_line_is_named_and_its_secret_is_not() {
        for (text, line, why) in [
            ("write ops:s3cret\nadmin ops2:hunter2\n", 2, "the scope"),
            ("\n# c\nwrite ops\n", 3, "name:secret"),
            ("read :hunter2\n", 1, "empty"),
            ("write hunter2\n", 1, "name:secret"),
            ("write ops:hunter2 trailing\n", 1, "no spaces"),
            ("writehunter2\n", 1, "expected"),
        ] {
            let (_d, path) = file(text, 0o400);
            let e = from_file(&path).unwrap_err().to_string();
            assert!(
                e.contains(&format!("line {line}:")) && e.contains(why),
                "{text:?}: {e}"
            );
            assert!(!e.contains("hunter2"), "{e}");
        }
        let (_d, path) = file("# nothing\n", 0o600);
        assert!(matches!(from_file(&path), Err(TokenError::Empty { .. })));
    }

    #[test]
    fn a_file_others_can_read_is_refused() {
        for mode in [0o644, 0o640, 0o604, 0o660] {
            let (_d, path) = file("write ops:s3cret\n", mode);
            let e = from_file(&path).unwrap_err();
            assert!(matches!(e, TokenError::Exposed { .. }), "{mode:o}: {e}");
            assert!(e.to_string().contains("readable by other users"), "{e}");
        }
    }

    #[test]
    fn one_secret_cannot_be_both_scopes() {
        let w = from_flag("ops:same", Scope::Write).unwrap();
        let r = from_flag("agents:same", Scope::Read).unwrap();
        assert!(check(&[w.clone(), r]).is_err());
        assert!(check(&[w.clone(), w]).is_ok());
        assert_eq!(from_flag("bare", Scope::Read).unwrap().name, "operator");
        let e = from_flag("ops:", Scope::Read).unwrap_err().to_string();
        assert!(e.contains("--read-token") && e.contains("neither empty"), "{e}");
    }

    #[test]
    fn a_secret_file_is_trimmed() {
        let (_d, path) = file("  s3cret\n", 0o600);
        assert_eq!(secret_from_file(&path).unwrap(), "s3cret");
        let (_d, path) = file("\n", 0o600);
        assert!(secret_from_file(&path).is_err());
    }
}
