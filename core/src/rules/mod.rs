//! Rules: the model, the rules file, and matching request attributes to rules.

mod descriptors;
pub mod envoy_config;
mod fail_list;
pub mod fields;
mod kinds;
mod matching;
mod model;
mod set;

pub use fail_list::fail_mode_list;
pub use matching::items_for;
pub use model::{
    validate_endpoint_pattern, Algorithm, Dimension, EnvoyEntry, EnvoyMatch, Execution, FailMode,
    InvalidRule, Match, Mode, OverLimit, ReservationExpiry, Rule, RuleError, RuleSet, EXAMPLE_RULES,
    MAX_ENVOY_DEPTH,
};
