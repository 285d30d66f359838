//! The decision ledger and its judge: what an agent admitted, written down as it decides, and a
//! checker that reads every agent's ledger of a run and judges each key-window against the
//! accuracy contract (`docs/accuracy.md`) without trusting the code that decided.
//!
//! - `record.rs`: one decided item as a ledger line (JSON), and the file's first line;
//! - `writer.rs`: the engine's side: a bounded queue the request path only `try_send`s to, and the
//!   thread that writes it to a file;
//! - `judge.rs`: the checker: key-windows by the store's clock, admitted units against the bound;
//! - `held.rs`: its concurrency part: units held at once against the bound.

mod held;
mod judge;
mod record;
mod writer;

pub use judge::{judge, Breach, FaultKind, FaultSpan, Judgement, LedgerFile, Options, RuleSummary};
pub use record::{Header, Record};
pub use writer::{Decided, Ledger, QUEUE_CAP};
