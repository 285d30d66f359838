//! Calendar quotas: an exact count per day, week, month or year in a time zone, back to zero at the
//! period's calendar boundary (local midnight; a week starts on Monday). The boundaries are the
//! agent's (Rust, with the IANA database); the counting is the same maths as `lua/quota.lua`.

use chrono::{Datelike, Duration, LocalResult, NaiveDate, TimeZone};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use super::Outcome;

/// A quota's calendar period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// From local midnight to the next.
    Day,
    /// From Monday's local midnight to the next Monday's.
    Week,
    /// From the 1st's local midnight to the next month's.
    Month,
    /// From January 1st's local midnight to the next year's.
    Year,
}

impl Period {
    /// The period's usual length in ms (a day, 7, 30 or 365 days), for what only needs a size (a
    /// fail-open answer's reset, Envoy's unit).
    pub fn nominal_ms(self) -> u64 {
        const DAY: u64 = 86_400_000;
        match self {
            Period::Day => DAY,
            Period::Week => 7 * DAY,
            Period::Month => 30 * DAY,
            Period::Year => 365 * DAY,
        }
    }

    /// Lower-case name, as in rules files.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        }
    }
}

/// The first day of the period holding `date`.
fn first_day(date: NaiveDate, period: Period) -> NaiveDate {
    match period {
        Period::Day => date,
        Period::Week => date - Duration::days(i64::from(date.weekday().num_days_from_monday())),
        Period::Month => date.with_day(1).unwrap_or(date),
        Period::Year => date.with_ordinal(1).unwrap_or(date),
    }
}

/// The first day of the period after the one starting on `first`.
fn next_first_day(first: NaiveDate, period: Period) -> NaiveDate {
    match period {
        Period::Day => first + Duration::days(1),
        Period::Week => first + Duration::days(7),
        Period::Month => first.checked_add_months(chrono::Months::new(1)).unwrap_or(first),
        Period::Year => first.checked_add_months(chrono::Months::new(12)).unwrap_or(first),
    }
}

/// Unix ms of `day`'s start in `tz`: local midnight, or where a DST change skips midnight, the first
/// instant of that day that exists; where midnight comes twice, the first.
fn day_start_ms(day: NaiveDate, tz: Tz) -> i64 {
    let mut t = day.and_hms_opt(0, 0, 0).unwrap_or_default();
    for _ in 0..48 {
        match tz.from_local_datetime(&t) {
            LocalResult::Single(d) => return d.timestamp_millis(),
            LocalResult::Ambiguous(a, _) => return a.timestamp_millis(),
            // Skipped by a DST change (a zone that moves its clocks at midnight): later.
            LocalResult::None => t += Duration::minutes(30),
        }
    }
    t.and_utc().timestamp_millis()
}

/// The period holding `now_ms` in `tz`: its start and end, Unix ms (end exclusive). A day is 23 or
/// 25 hours long across a DST change, as a customer's invoice counts it.
pub fn period_bounds(now_ms: u64, period: Period, tz: Tz) -> (u64, u64) {
    let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
    let local = tz
        .timestamp_millis_opt(now)
        .single()
        .map(|d| d.date_naive())
        .unwrap_or_default();
    let first = first_day(local, period);
    let start = day_start_ms(first, tz);
    let end = day_start_ms(next_first_day(first, period), tz);
    (start.max(0) as u64, end.max(0) as u64)
}

/// The period that starts at `start_ms` (a period's own start, as the counters are named): its
/// start and end.
pub fn period_from_start(start_ms: u64, period: Period, tz: Tz) -> (u64, u64) {
    // An hour in: safely inside the period whatever the DST change at its start.
    period_bounds(start_ms + 3_600_000, period, tz)
}

/// A consume of `cost` with `count` already counted this period: allowed when it fits; denied, the
/// wait is to the period's end.
pub fn quota(count: u64, limit: u64, cost: u64, now: u64, end: u64) -> (Outcome, u64) {
    let allowed = count + cost <= limit;
    let after = if allowed { count + cost } else { count };
    (answer(allowed, limit, after, now, end), after)
}

/// Whether `cost` would fit now, and what is left now (before any cost); nothing counted.
pub fn quota_peek(count: u64, limit: u64, cost: u64, now: u64, end: u64) -> Outcome {
    answer(count + cost <= limit, limit, count, now, end)
}

/// Counts `cost` whatever the limit says (a cost known after the response): the state after,
/// allowed while still within the limit.
pub fn quota_charge(count: u64, limit: u64, cost: u64, now: u64, end: u64) -> (Outcome, u64) {
    let after = count.saturating_add(cost);
    (answer(after <= limit, limit, after, now, end), after)
}

/// The figures with `after` counted; denied, the wait is to the period's end (`quota_answer` in
/// `lua/quota.lua`).
fn answer(allowed: bool, limit: u64, after: u64, now: u64, end: u64) -> Outcome {
    Outcome {
        allowed,
        limit,
        remaining: limit.saturating_sub(after),
        reset_at_ms: end,
        retry_after_ms: if allowed {
            0
        } else {
            end.saturating_sub(now).max(1)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDateTime;

    fn ms(tz: Tz, text: &str) -> u64 {
        let t = NaiveDateTime::parse_from_str(text, "%Y-%m-%d %H:%M").unwrap();
        tz.from_local_datetime(&t).earliest().unwrap().timestamp_millis() as u64
    }

    fn utc(text: &str) -> u64 {
        ms(chrono_tz::UTC, text)
    }

    #[test]
    fn months_end_at_the_next_first_in_their_zone() {
        let paris: Tz = "Europe/Paris".parse().unwrap();
        // 31 January, 23:30 in Paris: January still (22:30 UTC).
        let (start, end) = period_bounds(ms(paris, "2027-01-31 23:30"), Period::Month, paris);
        assert_eq!(start, ms(paris, "2027-01-01 00:00"));
        assert_eq!(end, ms(paris, "2027-02-01 00:00"));
        assert_eq!(end, utc("2027-01-31 23:00"), "Paris is UTC+1 in winter");
        // Half an hour later it is February there, still January in UTC.
        let feb = period_bounds(ms(paris, "2027-02-01 00:30"), Period::Month, paris);
        assert_eq!(feb.0, end);
        let in_utc = period_bounds(ms(paris, "2027-02-01 00:30"), Period::Month, chrono_tz::UTC);
        assert_eq!(in_utc.0, utc("2027-01-01 00:00"));
        // A leap year's February.
        let (s, e) = period_bounds(utc("2028-02-29 12:00"), Period::Month, chrono_tz::UTC);
        assert_eq!((s, e), (utc("2028-02-01 00:00"), utc("2028-03-01 00:00")));
        // December into the next year.
        let (_, e) = period_bounds(utc("2027-12-31 23:59"), Period::Month, chrono_tz::UTC);
        assert_eq!(e, utc("2028-01-01 00:00"));
    }

    #[test]
    fn a_day_across_a_dst_change_is_23_or_25_hours() {
        let paris: Tz = "Europe/Paris".parse().unwrap();
        let (s, e) = period_bounds(ms(paris, "2027-03-28 12:00"), Period::Day, paris);
        assert_eq!(e - s, 23 * 3_600_000, "spring forward");
        let (s, e) = period_bounds(ms(paris, "2027-10-31 12:00"), Period::Day, paris);
        assert_eq!(e - s, 25 * 3_600_000, "fall back");
        // A zone that skips midnight itself (Santiago moves 00:00 → 01:00 in September).
        let santiago: Tz = "America/Santiago".parse().unwrap();
        let (s, e) = period_bounds(ms(santiago, "2027-09-05 12:00"), Period::Day, santiago);
        assert!(e > s && e - s <= 24 * 3_600_000, "{s} {e}");
    }

    #[test]
    fn weeks_start_on_monday_and_years_on_january_first() {
        let tokyo: Tz = "Asia/Tokyo".parse().unwrap();
        // Wednesday 2027-03-10.
        let (s, e) = period_bounds(ms(tokyo, "2027-03-10 08:00"), Period::Week, tokyo);
        assert_eq!(
            (s, e),
            (ms(tokyo, "2027-03-08 00:00"), ms(tokyo, "2027-03-15 00:00"))
        );
        let (s, e) = period_bounds(ms(tokyo, "2027-07-01 00:00"), Period::Year, tokyo);
        assert_eq!(
            (s, e),
            (ms(tokyo, "2027-01-01 00:00"), ms(tokyo, "2028-01-01 00:00"))
        );
        assert_eq!(period_from_start(s, Period::Year, tokyo), (s, e));
    }

    #[test]
    fn counts_exactly_and_waits_for_the_period_end() {
        let (o, n) = quota(8, 10, 2, 1_000, 5_000);
        assert!(o.allowed && o.remaining == 0 && n == 10 && o.reset_at_ms == 5_000);
        let (o, n) = quota(10, 10, 1, 1_000, 5_000);
        assert!(!o.allowed && n == 10 && o.retry_after_ms == 4_000);
        let (o, n) = quota_charge(9, 10, 5, 1_000, 5_000);
        assert!(!o.allowed && n == 14 && o.remaining == 0);
        let p = quota_peek(4, 10, 6, 0, 1);
        assert!(
            p.allowed && p.remaining == 6,
            "a peek's remaining is before its cost"
        );
    }
}
