//! What can go wrong while decoding or encoding a frame, and the error codes carried by `Error` frames.

/// An error code carried by an `Error` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The bytes do not form a frame; the agent closes the connection after saying so.
    MalformedFrame,
    /// The length prefix announces more than [`crate::MAX_FRAME`]; the connection is closed.
    FrameTooLarge,
    /// No protocol version both peers speak.
    UnsupportedVersion,
    /// A check names a rule id the agent does not have.
    UnknownRule,
    /// A well-formed frame with content outside the limits (key too long, cost 0, a brace in a key…).
    InvalidItem,
    /// A frame kind that only the other side may send (a client sending a `Decision`).
    UnexpectedFrame,
    /// The agent cannot take more work on this connection right now.
    Overloaded,
    /// A bug or an unexpected state inside the agent.
    Internal,
    /// A code this version does not know (sent by a newer peer).
    Unknown(u16),
}

impl ErrorCode {
    /// The code on the wire.
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::MalformedFrame => 1,
            ErrorCode::FrameTooLarge => 2,
            ErrorCode::UnsupportedVersion => 3,
            ErrorCode::UnknownRule => 4,
            ErrorCode::InvalidItem => 5,
            ErrorCode::UnexpectedFrame => 6,
            ErrorCode::Overloaded => 7,
            ErrorCode::Internal => 8,
            ErrorCode::Unknown(c) => c,
        }
    }

    /// The code for a wire value.
    pub fn from_u16(code: u16) -> Self {
        match code {
            1 => ErrorCode::MalformedFrame,
            2 => ErrorCode::FrameTooLarge,
            3 => ErrorCode::UnsupportedVersion,
            4 => ErrorCode::UnknownRule,
            5 => ErrorCode::InvalidItem,
            6 => ErrorCode::UnexpectedFrame,
            7 => ErrorCode::Overloaded,
            8 => ErrorCode::Internal,
            c => ErrorCode::Unknown(c),
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ErrorCode::MalformedFrame => "malformed frame",
            ErrorCode::FrameTooLarge => "frame too large",
            ErrorCode::UnsupportedVersion => "unsupported version",
            ErrorCode::UnknownRule => "unknown rule",
            ErrorCode::InvalidItem => "invalid item",
            ErrorCode::UnexpectedFrame => "unexpected frame",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Internal => "internal error",
            ErrorCode::Unknown(c) => return write!(f, "error code {c}"),
        };
        f.write_str(name)
    }
}

/// Why [`crate::decode`] could not produce a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not enough bytes yet: read more and call again. Normal on a stream, not an error.
    #[error("incomplete frame")]
    Incomplete,
    /// The stream cannot be trusted any more: the peer should be told and the connection closed.
    #[error("{code}: {reason}")]
    Fatal {
        /// `MalformedFrame` or `FrameTooLarge`.
        code: ErrorCode,
        /// The request id, when the header was readable.
        request_id: Option<u32>,
        /// What was wrong.
        reason: String,
    },
    /// The frame was well delimited but its content is refused; skip `frame_len` bytes and go on.
    #[error("{code}: {reason}")]
    Rejected {
        /// Why, as a wire code.
        code: ErrorCode,
        /// The request id of the refused frame.
        request_id: u32,
        /// What was wrong.
        reason: String,
        /// The whole frame's length, prefix included, to skip.
        frame_len: usize,
    },
}

/// Why a frame could not be encoded: it would break a limit the peer enforces.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// An item, attribute or count is outside the protocol's limits.
    #[error("invalid item: {0}")]
    Invalid(String),
    /// The encoded frame would exceed [`crate::MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the 64 KiB limit")]
    TooLarge(usize),
}

/// A value outside the protocol's limits: what [`crate::Check::validate`] and the other `validate`
/// functions refuse (and what an agent answers with [`ErrorCode::InvalidItem`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidValue {
    /// A key or attribute that is present but empty.
    #[error("{field} is empty")]
    Empty {
        /// `key`, `endpoint`, `tier`, `user`, `apiKey` or `ip`.
        field: &'static str,
    },
    /// Longer than its limit, in bytes of UTF-8.
    #[error("{field} is {len} bytes, over the {max}-byte limit")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A brace (a Redis hash tag) or a control character.
    #[error("{field} contains {found:?}: braces (Redis hash tags) and control characters are not allowed")]
    Forbidden {
        /// The field.
        field: &'static str,
        /// The character.
        found: char,
    },
    /// A cost of 0 on an item that is not a peek or a commit.
    #[error("cost must be at least 1")]
    ZeroCost,
    /// A reserve or a commit without its reservation id (version 6).
    #[error("a {0} item needs its reservation id")]
    NoReservationId(&'static str),
    /// An item mode this peer does not know.
    #[error("unknown item mode {0}")]
    UnknownMode(u8),
    /// A check with no items, or more than [`crate::MAX_ITEMS`].
    #[error("a check carries 1 to {max} items, not {count}", max = crate::MAX_ITEMS)]
    ItemCount {
        /// How many it carries.
        count: usize,
    },
    /// A rule id of 0 or more than [`crate::MAX_RULE_ID`] bytes.
    #[error("rule id must be 1 to {max} bytes, not {len}", max = crate::MAX_RULE_ID)]
    RuleIdLength {
        /// Its length.
        len: usize,
    },
    /// A rule id with a character outside `[A-Za-z0-9_.:-]`.
    #[error("rule id {rule_id:?} contains {found:?}: only ASCII letters, digits and _ - . : are allowed")]
    RuleIdChar {
        /// The rule id.
        rule_id: String,
        /// The character.
        found: char,
    },
}
