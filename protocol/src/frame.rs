//! The frames Floodgate peers exchange, as plain Rust values.

pub use crate::decision::{Decision, ErrorBody, ItemDecision, Source, Verdict};
use crate::limits::{MAX_ATTRIBUTE, MAX_ITEMS, MAX_KEY, MAX_RULE_ID};
use crate::InvalidValue;
pub use compact_str::CompactString;

/// One frame: a request id and what it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Chosen by the client; the agent answers with the same id. Many may be in flight on one connection.
    pub request_id: u32,
    /// The frame's content.
    pub body: Body,
    /// A check's trace context (version 5: form 4 wraps the check's form); None on other frames.
    pub trace: Option<crate::TraceContext>,
}

/// What a frame carries.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Body {
    /// Client → agent: the range of versions the client speaks.
    Hello {
        /// Lowest version the client speaks.
        min_version: u8,
        /// Highest version the client speaks.
        max_version: u8,
    },
    /// Agent → client: the version chosen for this connection.
    HelloOk {
        /// The chosen version.
        version: u8,
    },
    /// Client → agent: a limit check.
    Check(Check),
    /// Agent → client: the answer to a check.
    Decision(Decision),
    /// Either way: something went wrong with one request (or the connection, with request id 0).
    Error(ErrorBody),
    /// Client → agent: liveness probe.
    Ping,
    /// Agent → client: answer to a ping.
    Pong,
    /// Client → agent (version 2): which rules fail closed.
    FailModes,
    /// Agent → client (version 2): the rules that fail closed, for the SDK to apply while the agent is away.
    FailModeList(crate::FailModeList),
}

/// A limit check: explicit items, or request attributes for the agent to match against its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// 1 to 16 `(key, ruleId, cost)` items; allowed only if every item is.
    Items(Vec<Item>),
    /// Request attributes; the agent checks every rule that matches them.
    Attributes(Attributes),
}

/// What an item does with its cost (protocol version 2; version 1 knows only `Consume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ItemMode {
    /// Takes the cost if the check passes (all or nothing with the check's other consume items).
    #[default]
    Consume,
    /// Changes nothing: says whether the cost would pass, and what is left now.
    Peek,
    /// Always takes the cost, even past the limit (a debt later checks wait out); never a rejection.
    Charge,
    /// Gives units back to a concurrency rule (version 3): the item's lease, or without one up to
    /// `cost` units of the key's leases; never a rejection.
    Release,
    /// Takes `cost` as a consume does and holds it under the item's reservation id (version 6),
    /// until a commit with the same id settles it or the rule's `reservationSeconds` run out.
    Reserve,
    /// Settles the reservation named by the item's id (version 6): `cost` is what the request
    /// actually used (0 allowed); the reserved units past it go back, a use past them is charged.
    /// Never a rejection.
    Commit,
}

impl ItemMode {
    /// Takes its cost only if the check passes, and decides it (a consume). Each of these
    /// predicates is an exhaustive match, so a new mode makes the compiler ask each question of it.
    pub fn takes_if_passed(self) -> bool {
        match self {
            ItemMode::Consume | ItemMode::Reserve => true,
            ItemMode::Peek | ItemMode::Charge | ItemMode::Release | ItemMode::Commit => false,
        }
    }

    /// Takes its cost whatever the verdict (a charge, a commit): never a rejection.
    pub fn always_takes(self) -> bool {
        match self {
            ItemMode::Charge | ItemMode::Commit => true,
            ItemMode::Consume | ItemMode::Peek | ItemMode::Release | ItemMode::Reserve => false,
        }
    }

    /// Adds its cost to the key's count when admitted (a consume, a reserve or a charge).
    pub fn counts(self) -> bool {
        match self {
            ItemMode::Consume | ItemMode::Charge | ItemMode::Reserve | ItemMode::Commit => true,
            ItemMode::Peek | ItemMode::Release => false,
        }
    }

    /// Only looks (a peek): changes nothing, may cost 0.
    pub fn only_looks(self) -> bool {
        match self {
            ItemMode::Peek => true,
            ItemMode::Consume
            | ItemMode::Charge
            | ItemMode::Release
            | ItemMode::Reserve
            | ItemMode::Commit => false,
        }
    }

    /// Gives units back to a concurrency rule (a release): never a rejection.
    pub fn gives_back(self) -> bool {
        match self {
            ItemMode::Release => true,
            ItemMode::Consume | ItemMode::Peek | ItemMode::Charge | ItemMode::Reserve | ItemMode::Commit => {
                false
            }
        }
    }

    /// Can be refused (a consume, a reserve or a peek).
    pub fn can_refuse(self) -> bool {
        match self {
            ItemMode::Consume | ItemMode::Peek | ItemMode::Reserve => true,
            ItemMode::Charge | ItemMode::Release | ItemMode::Commit => false,
        }
    }

    /// Names a reservation (a reserve or a commit): it needs an id, and decides its rule's items
    /// in the agent's reservations as well as in the store (version 6).
    pub fn reserves(self) -> bool {
        match self {
            ItemMode::Reserve | ItemMode::Commit => true,
            ItemMode::Consume | ItemMode::Peek | ItemMode::Charge | ItemMode::Release => false,
        }
    }

    /// Its denial is cached until its key could pass, and answered from the cache (a consume). A
    /// reserve's is not: a commit may give units back at any moment, as a release may.
    pub fn caches_denial(self) -> bool {
        match self {
            ItemMode::Consume => true,
            ItemMode::Peek | ItemMode::Charge | ItemMode::Release | ItemMode::Reserve | ItemMode::Commit => {
                false
            }
        }
    }

    /// May cost 0: a peek asks about nothing, a commit says the request used nothing.
    pub fn may_cost_nothing(self) -> bool {
        match self {
            ItemMode::Peek | ItemMode::Commit => true,
            ItemMode::Consume | ItemMode::Charge | ItemMode::Release | ItemMode::Reserve => false,
        }
    }

    /// The byte on the wire.
    pub fn to_u8(self) -> u8 {
        match self {
            ItemMode::Consume => 0,
            ItemMode::Peek => 1,
            ItemMode::Charge => 2,
            ItemMode::Release => 3,
            ItemMode::Reserve => 4,
            ItemMode::Commit => 5,
        }
    }

    /// The mode for a wire byte.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            0 => ItemMode::Consume,
            1 => ItemMode::Peek,
            2 => ItemMode::Charge,
            3 => ItemMode::Release,
            4 => ItemMode::Reserve,
            5 => ItemMode::Commit,
            _ => return None,
        })
    }

    /// Lower-case name, as in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ItemMode::Consume => "consume",
            ItemMode::Peek => "peek",
            ItemMode::Charge => "charge",
            ItemMode::Release => "release",
            ItemMode::Reserve => "reserve",
            ItemMode::Commit => "commit",
        }
    }
}

/// One `(key, ruleId, cost)` item of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The client key, e.g. `user:123` or `apikey:abc:endpoint:/search` (inline up to 24 bytes).
    pub key: CompactString,
    /// The rule to check the key against.
    pub rule_id: CompactString,
    /// How many units this request consumes (at least 1; a peek may ask about 0).
    pub cost: u32,
    /// What the item does with its cost.
    pub mode: ItemMode,
    /// The client's lease id (version 3): a concurrency rule's units taken under it are released by
    /// it. Ignored by other rules.
    pub lease: Option<u64>,
}

impl Item {
    /// An item that consumes its cost; validated when encoded or by [`Item::validate`].
    pub fn new(key: impl Into<CompactString>, rule_id: impl Into<CompactString>, cost: u32) -> Self {
        Item {
            key: key.into(),
            rule_id: rule_id.into(),
            cost,
            mode: ItemMode::Consume,
            lease: None,
        }
    }

    /// An item that asks whether `cost` would pass, changing nothing.
    pub fn peek(key: impl Into<CompactString>, rule_id: impl Into<CompactString>, cost: u32) -> Self {
        Item {
            mode: ItemMode::Peek,
            ..Item::new(key, rule_id, cost)
        }
    }

    /// An item that takes `cost` whatever the limit says (a cost known after the response).
    pub fn charge(key: impl Into<CompactString>, rule_id: impl Into<CompactString>, cost: u32) -> Self {
        Item {
            mode: ItemMode::Charge,
            ..Item::new(key, rule_id, cost)
        }
    }

    /// An item that takes `cost` units of a concurrency rule under `lease` (any other rule: consumes
    /// `cost`); release them with [`Item::release`] and the same lease and cost.
    pub fn acquire(
        key: impl Into<CompactString>,
        rule_id: impl Into<CompactString>,
        cost: u32,
        lease: u64,
    ) -> Self {
        Item {
            lease: Some(lease),
            ..Item::new(key, rule_id, cost)
        }
    }

    /// An item that gives back the units a concurrency rule holds under `lease` (`None`: up to `cost`
    /// units of the key's leases, soonest to expire first).
    pub fn release(
        key: impl Into<CompactString>,
        rule_id: impl Into<CompactString>,
        cost: u32,
        lease: Option<u64>,
    ) -> Self {
        Item {
            mode: ItemMode::Release,
            lease,
            ..Item::new(key, rule_id, cost)
        }
    }

    /// An item that reserves `cost` (e.g. a request's `max_tokens`) under the reservation id
    /// `id`, if the check passes; settle it with [`Item::commit`] and the same id.
    pub fn reserve(
        key: impl Into<CompactString>,
        rule_id: impl Into<CompactString>,
        cost: u32,
        id: u64,
    ) -> Self {
        Item {
            mode: ItemMode::Reserve,
            lease: Some(id),
            ..Item::new(key, rule_id, cost)
        }
    }

    /// An item that settles the reservation `id` at what the request used (`used`, 0 allowed).
    pub fn commit(
        key: impl Into<CompactString>,
        rule_id: impl Into<CompactString>,
        used: u32,
        id: u64,
    ) -> Self {
        Item {
            mode: ItemMode::Commit,
            lease: Some(id),
            ..Item::new(key, rule_id, used)
        }
    }

    /// Checks the item against the protocol's limits.
    #[inline]
    pub fn validate(&self) -> Result<(), InvalidValue> {
        validate_text("key", &self.key, MAX_KEY)?;
        validate_rule_id(&self.rule_id)?;
        check_mode(self.mode, self.cost, self.lease)
    }
}

/// Request attributes the agent matches against its rules.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Attributes {
    /// The matched route or path, e.g. `/search`.
    pub endpoint: Option<String>,
    /// The client tier, e.g. `free` or `pro`.
    pub tier: Option<String>,
    /// The user id.
    pub user: Option<String>,
    /// The API key.
    pub api_key: Option<String>,
    /// The client IP address.
    pub ip: Option<String>,
    /// How many units this request consumes (at least 1; a peek may ask about 0).
    pub cost: u32,
    /// What every matched rule's item does with the cost.
    pub mode: ItemMode,
    /// The client's lease id for every matched concurrency rule (version 3).
    pub lease: Option<u64>,
}

impl Attributes {
    /// Checks the attributes against the protocol's limits.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        for (name, value) in self.fields() {
            if let Some(v) = value {
                validate_text(name, v, MAX_ATTRIBUTE)?;
            }
        }
        check_mode(self.mode, self.cost, self.lease)
    }

    /// The attributes with their names, in wire order.
    pub fn fields(&self) -> [(&'static str, &Option<String>); 5] {
        [
            ("endpoint", &self.endpoint),
            ("tier", &self.tier),
            ("user", &self.user),
            ("apiKey", &self.api_key),
            ("ip", &self.ip),
        ]
    }
}

impl Check {
    /// Checks the whole check against the protocol's limits.
    pub fn validate(&self) -> Result<(), InvalidValue> {
        match self {
            Check::Items(items) => {
                if items.is_empty() || items.len() > MAX_ITEMS {
                    return Err(InvalidValue::ItemCount { count: items.len() });
                }
                items.iter().try_for_each(Item::validate)
            }
            Check::Attributes(a) => a.validate(),
        }
    }
}

/// Whether a mode's cost and id fit it: a cost of 0 only where the mode may cost nothing, and a
/// reservation id on every reserve and commit.
#[inline]
fn check_mode(mode: ItemMode, cost: u32, id: Option<u64>) -> Result<(), InvalidValue> {
    if cost == 0 && !mode.may_cost_nothing() {
        return Err(InvalidValue::ZeroCost);
    }
    if mode.reserves() && id.is_none() {
        return Err(InvalidValue::NoReservationId(mode.as_str()));
    }
    Ok(())
}

/// Whether a key or attribute may be sent: 1 to `max` bytes, no brace, no control character. The
/// check is the hot path's (every item of every check); which limit broke is worked out apart.
#[inline]
fn validate_text(field: &'static str, value: &str, max: usize) -> Result<(), InvalidValue> {
    let ok = !value.is_empty()
        && value.len() <= max
        && !value.chars().any(|c| c == '{' || c == '}' || c.is_control());
    if ok {
        Ok(())
    } else {
        Err(text_error(field, value, max))
    }
}

#[cold]
#[inline(never)]
fn text_error(field: &'static str, value: &str, max: usize) -> InvalidValue {
    if value.is_empty() {
        return InvalidValue::Empty { field };
    }
    if value.len() > max {
        return InvalidValue::TooLong {
            field,
            len: value.len(),
            max,
        };
    }
    let found = value
        .chars()
        .find(|c| *c == '{' || *c == '}' || c.is_control())
        .unwrap_or_default();
    InvalidValue::Forbidden { field, found }
}

/// Checks a rule id: 1 to 128 bytes of ASCII letters, digits and `_ - . :`.
#[inline]
pub fn validate_rule_id(rule_id: &str) -> Result<(), InvalidValue> {
    let ok = !rule_id.is_empty()
        && rule_id.len() <= MAX_RULE_ID
        && rule_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(rule_id_error(rule_id))
    }
}

#[cold]
#[inline(never)]
fn rule_id_error(rule_id: &str) -> InvalidValue {
    if rule_id.is_empty() || rule_id.len() > MAX_RULE_ID {
        return InvalidValue::RuleIdLength { len: rule_id.len() };
    }
    let found = rule_id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')))
        .unwrap_or_default();
    InvalidValue::RuleIdChar {
        rule_id: rule_id.to_string(),
        found,
    }
}
