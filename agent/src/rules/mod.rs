//! Rules: the model, the rules file, and matching request attributes to rules.

mod matching;
mod model;

pub use matching::items_for;
pub use model::{
    Algorithm, Dimension, Execution, FailMode, Match, Mode, Rule, RuleError, RuleSet, EXAMPLE_RULES,
};
