//! Resolving a check into planned items: rules by id (or matched by attributes), each item's mode,
//! lease and cost, overrides and penalties applied, and the check's limits (items, no pair twice).

use std::sync::atomic::Ordering;

use floodgate_protocol::{Check, Decision, ErrorBody, ErrorCode, Source, MAX_ITEMS};

use super::{finish, Engine};
use crate::algo::Outcome;
use crate::rules::{items_for, Rule};
use crate::store::{ItemMode, Lease, Planned};

impl Engine {
    /// Applies the penalties of the check's keys: a scaled limit, or (a block) the check refused at
    /// once, the blocked items waiting for the penalty's end and the others reporting their rule.
    pub(super) fn penalize(&self, plan: &mut [Planned]) -> Option<Decision> {
        let now = self.clock.now_ms();
        let mut blocked: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
        let mut any = false;
        // A check that gives units back is never blocked: its release must land (its rate rules'
        // items are looks of 0 then).
        let releases = plan.iter().any(|p| p.mode.gives_back());
        for (i, p) in plan.iter_mut().enumerate() {
            match self.overrides.penalized(&p.rule, &p.key, now) {
                Some(crate::overrides::Penalized::Rule(r)) => p.rule = r,
                Some(crate::overrides::Penalized::Blocked(until))
                    if !releases && p.rule.enforced() && p.mode.can_refuse() =>
                {
                    any = true;
                    let limit = p.rule.display_limit();
                    let o = Outcome {
                        allowed: false,
                        limit,
                        remaining: 0,
                        reset_at_ms: until,
                        retry_after_ms: until.saturating_sub(now).max(1),
                    };
                    blocked[i] = Some((o, Source::Local));
                }
                _ => {}
            }
        }
        any.then(|| finish(plan, blocked))
    }

    /// What an item does to its rule: a concurrency rule's consume acquires under the client's lease
    /// (or one the agent picks), its charge is a peek; another rule's release is a peek of 0. A
    /// reserve or a commit keeps its reservation id as its lease (`reserve.rs` settles a commit).
    pub(super) fn item_mode(
        &self,
        rule: &Rule,
        mode: ItemMode,
        lease: Option<u64>,
        cost: u32,
    ) -> (ItemMode, Lease, u64) {
        let cost = u64::from(cost);
        if !rule.is_concurrency() {
            return match (mode, lease) {
                (ItemMode::Release, _) => (ItemMode::Peek, Lease::None, 0),
                (ItemMode::Reserve | ItemMode::Commit, Some(id)) => (mode, Lease::Client(id), cost),
                // Validated away (a reserve or a commit has its id): what it would be without one.
                (ItemMode::Reserve, None) => (ItemMode::Consume, Lease::None, cost),
                (ItemMode::Commit, None) => (ItemMode::Charge, Lease::None, cost),
                (ItemMode::Consume | ItemMode::Peek | ItemMode::Charge, _) => (mode, Lease::None, cost),
            };
        }
        match (mode, lease) {
            // A peek with a lease (the request phase of a cost known after the response) holds a
            // unit of each concurrency rule it matches while the request runs.
            (ItemMode::Peek, Some(id)) => (ItemMode::Consume, Lease::Client(id), cost.max(1)),
            (ItemMode::Consume, Some(id)) => (mode, Lease::Client(id), cost),
            (ItemMode::Consume, None) => (mode, Lease::Agent(self.agent_lease()), cost),
            (ItemMode::Release, Some(id)) => (mode, Lease::Client(id), cost),
            (ItemMode::Release, None) => (mode, Lease::None, cost),
            // A reservation of units in flight is an acquire under its id; its commit a release.
            (ItemMode::Reserve | ItemMode::Commit, Some(id)) => (mode, Lease::Client(id), cost),
            (ItemMode::Reserve, None) => (ItemMode::Consume, Lease::Agent(self.agent_lease()), cost),
            (ItemMode::Commit, None) => (ItemMode::Peek, Lease::None, cost),
            (ItemMode::Peek | ItemMode::Charge, _) => (ItemMode::Peek, Lease::None, cost),
        }
    }

    /// A lease id of the agent's own.
    pub(super) fn agent_lease(&self) -> u64 {
        let n = self.lease_seq.fetch_add(1, Ordering::Relaxed);
        splitmix64(
            self.lease_seed
                .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        )
    }

    pub(super) fn plan(&self, check: Check) -> Result<Vec<Planned>, ErrorBody> {
        let rules = self.rules();
        let plan: Vec<Planned> = match check {
            Check::Items(items) => items
                .into_iter()
                .map(|item| match rules.get(&item.rule_id) {
                    Some(rule) => {
                        // An item's peek only looks, lease or not.
                        let lease = item.lease.filter(|_| !item.mode.only_looks());
                        let (mode, lease, cost) = self.item_mode(rule, item.mode, lease, item.cost);
                        Ok(Planned {
                            rule: rule.clone(),
                            key: item.key,
                            cost,
                            mode,
                            lease,
                        })
                    }
                    None => Err(ErrorBody {
                        code: ErrorCode::UnknownRule,
                        message: format!("unknown rule {:?}", item.rule_id),
                    }),
                })
                .collect::<Result<_, _>>()?,
            Check::Attributes(a) => items_for(&rules, &a)
                .into_iter()
                .map(|(rule, key)| {
                    let (mode, lease, cost) = self.item_mode(&rule, a.mode, a.lease, a.cost);
                    Planned {
                        rule,
                        key: key.into(),
                        cost,
                        mode,
                        lease,
                    }
                })
                .collect(),
        };
        let mut plan = plan;
        if !self.overrides.is_empty() {
            // A client key with an override is checked under the rule its override makes.
            let now = self.clock.now_ms();
            for p in &mut plan {
                if let Some(rule) = self.overrides.rule_for(&p.rule, &p.key, now) {
                    p.rule = rule;
                }
            }
        }
        if plan.len() > MAX_ITEMS {
            return Err(ErrorBody {
                code: ErrorCode::InvalidItem,
                message: format!(
                    "{} rules matched; at most {MAX_ITEMS} can be checked at once",
                    plan.len()
                ),
            });
        }
        for (i, p) in plan.iter().enumerate() {
            if plan[..i].iter().any(|q| q.rule.id == p.rule.id && q.key == p.key) {
                return Err(ErrorBody {
                    code: ErrorCode::InvalidItem,
                    message: format!("item ({:?}, {:?}) appears twice in one check", p.key, p.rule.id),
                });
            }
        }
        Ok(plan)
    }
}

/// A per-process seed for the agent's lease ids: the clock's nanoseconds and the process id.
pub(super) fn lease_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    splitmix64(nanos ^ (u64::from(std::process::id()) << 32))
}

/// SplitMix64's output function: spreads a sequence over all 64 bits.
pub(super) fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
