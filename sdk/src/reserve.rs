//! Reservations (protocol version 6): reserve what a request may use before it runs (`max_tokens`,
//! or an estimate), commit what it used after; the agent gives the rest back, or charges a use past
//! it. Several meters (input tokens, output tokens, cost, requests in flight) are reserved all or
//! nothing in one check and committed in one more.
//!
//! One LLM request (docs/sdks.md's recipe):
//!
//! ```no_run
//! use floodgate_sdk::{Client, Meter};
//!
//! # async fn run(client: Client, prompt_tokens: u32, max_tokens: u32) -> Result<(), floodgate_sdk::Error> {
//! let key = "apikey:abc";
//! let (decision, reservation) = client
//!     .reserve_meters(vec![
//!         Meter::new(key, "input-tokens", prompt_tokens),
//!         Meter::new(key, "output-tokens", max_tokens),
//!         Meter::new(key, "llm-in-flight", 1),
//!     ])
//!     .await?;
//! if !decision.allowed {
//!     return Ok(()); // 429 with decision.retry_after_ms
//! }
//! // ... call the model; it reports what it used ...
//! let (used_in, used_out) = (prompt_tokens, 612);
//! if let Some(r) = reservation {
//!     client.commit(&r, &[used_in, used_out, 1]).await?;
//! }
//! # Ok(())
//! # }
//! ```

use floodgate_protocol::Item;

use crate::{Client, Decision, Error};

/// One meter of a reservation: a (key, rule) and the units reserved on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    /// The client key, e.g. `apikey:abc`.
    pub key: String,
    /// The rule that meters it, e.g. `output-tokens`.
    pub rule_id: String,
    /// The units reserved (a commit says what was used).
    pub units: u32,
}

impl Meter {
    /// A meter of `units` on (`key`, `rule_id`).
    pub fn new(key: impl Into<String>, rule_id: impl Into<String>, units: u32) -> Self {
        Meter {
            key: key.into(),
            rule_id: rule_id.into(),
            units,
        }
    }
}

/// A reservation the agent holds: commit it with [`Client::commit`] once the request's use is
/// known; one never committed expires after its rules' `reservationSeconds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// Its id, chosen by this client.
    pub id: u64,
    /// Its meters, in the order they were reserved.
    pub meters: Vec<Meter>,
    /// Which meters the agent holds, in that order: all, except a quota-mode meter
    /// (`overLimit = "flag"`) the request passed flagged, which took nothing.
    pub held: Vec<bool>,
}

impl Client {
    /// Reserves `units` of `rule_id` for `key`: the decision, and the reservation if the agent
    /// holds it. When the agent cannot answer, the decision is the fail policy's and there is none.
    pub async fn reserve(
        &self,
        key: &str,
        rule_id: &str,
        units: u32,
    ) -> Result<(Decision, Option<Reservation>), Error> {
        self.reserve_meters(vec![Meter::new(key, rule_id, units)]).await
    }

    /// Reserves every meter at once, all or nothing (at most 16): the decision, and the reservation
    /// if the agent holds all of it.
    pub async fn reserve_meters(&self, meters: Vec<Meter>) -> Result<(Decision, Option<Reservation>), Error> {
        let id = self.shared.next_lease();
        let items = meters
            .iter()
            .map(|m| Item::reserve(m.key.as_str(), m.rule_id.as_str(), m.units, id))
            .collect();
        let d = self.check(items).await?;
        let held = d.items.iter().map(|i| i.verdict.holds_lease).collect();
        let reservation = Reservation { id, meters, held };
        if !d.from_agent_answer() {
            // Late or lost: the agent may still hold it. Committed at 0 at once, off the caller's
            // path (a commit of a reservation not held gives nothing back and charges nothing under
            // the default `reservationExpiry`).
            let (client, r) = (
                self.clone(),
                Reservation {
                    held: vec![true; reservation.meters.len()],
                    ..reservation.clone()
                },
            );
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let used = vec![0; r.meters.len()];
                    let _ = client.commit(&r, &used).await;
                });
            }
            return Ok((d, None));
        }
        // Held when the check passed: every meter, but one a quota-mode rule let through flagged.
        let held = d.allowed && reservation.held.iter().any(|&h| h);
        Ok((d, held.then_some(reservation)))
    }

    /// Settles `reservation` at what the request used, one figure per meter in its order (0 for a
    /// meter it did not use): the unused units go back, a use past the reservation is charged.
    /// Never a rejection; its figures are each meter's after the commit.
    pub async fn commit(&self, reservation: &Reservation, used: &[u32]) -> Result<Decision, Error> {
        if used.len() != reservation.meters.len() {
            return Err(Error::Invalid(format!(
                "{} figures for a reservation of {} meters",
                used.len(),
                reservation.meters.len()
            )));
        }
        let items: Vec<Item> = reservation
            .meters
            .iter()
            .zip(used)
            .zip(reservation.held.iter().chain(std::iter::repeat(&true)))
            // Only the meters the agent holds (a flagged quota-mode meter took nothing). A meter
            // of units in flight (a concurrency rule) is released whole, whatever the figure.
            .filter(|(_, &held)| held)
            .map(|((m, &u), _)| Item::commit(m.key.as_str(), m.rule_id.as_str(), u, reservation.id))
            .collect();
        if items.is_empty() {
            return Err(Error::Invalid("the reservation holds no meter".into()));
        }
        self.check(items).await
    }
}
