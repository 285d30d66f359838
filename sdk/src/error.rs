//! Errors a call can return: only what no fail policy can answer for the caller.

use floodgate_protocol::ErrorCode;

/// Why a check returned no decision. Unavailability and lateness never show up here: they are
/// answered by the fail policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The check breaks a protocol limit (key too long, cost 0, a brace in a key, too many items).
    #[error("invalid check: {0}")]
    Invalid(String),
    /// The agent refused the check (an unknown rule id, an invalid item).
    #[error("agent refused the check ({code}): {message}")]
    Agent {
        /// The agent's error code.
        code: ErrorCode,
        /// The agent's explanation.
        message: String,
    },
}
