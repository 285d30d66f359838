//! A rule as the rules API receives it: checked field by field, so that a 400 names every bad field
//! with its reason, not just the first serde error.

use std::collections::BTreeMap;

use serde_json::Value;

use super::model::{validate_endpoint_pattern, Rule};

/// Field name → what is wrong with it.
pub type FieldErrors = BTreeMap<String, String>;

const FIELDS: [&str; 19] = [
    "id",
    "dimension",
    "match",
    "limit",
    "windowSeconds",
    "leaseSeconds",
    "reservationSeconds",
    "reservationExpiry",
    "period",
    "timezone",
    "burst",
    "algorithm",
    "mode",
    "failMode",
    "overLimit",
    "execution",
    "flushIntervalMs",
    "perEndpoint",
    "envoy",
];

fn one_of(v: &Value, allowed: &[&str]) -> Result<(), String> {
    match v.as_str() {
        Some(s) if allowed.contains(&s) => Ok(()),
        _ => Err(format!("must be one of {}", allowed.join(", "))),
    }
}

fn integer(v: &Value, min: u64, max: u64) -> Result<(), String> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(()),
        _ => Err(format!("must be an integer from {min} to {max}")),
    }
}

/// Parses a PUT body for rule `id`: every field checked, unknown fields refused; the whole rule then
/// checked once more as the agent would (`Rule::check`).
pub fn rule_from_body(id: &str, body: &[u8]) -> Result<Rule, FieldErrors> {
    let mut errors = FieldErrors::new();
    let value: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            errors.insert("body".into(), format!("not JSON: {e}"));
            return Err(errors);
        }
    };
    let Some(obj) = value.as_object() else {
        errors.insert("body".into(), "must be a JSON object".into());
        return Err(errors);
    };
    if let Err(e) = floodgate_protocol::validate_rule_id(id) {
        errors.insert("id".into(), e.to_string());
    }
    for (k, v) in obj {
        let check = match k.as_str() {
            "id" => match v.as_str() {
                Some(s) if s == id => Ok(()),
                _ => Err(format!("must be {id:?} (the id in the path) or left out")),
            },
            "dimension" => one_of(v, &["user", "api_key", "ip", "descriptor"]),
            "limit" => integer(v, 1, 1 << 50),
            "burst" => integer(v, 1, 1 << 50),
            "windowSeconds" => match v.as_f64() {
                Some(w) if (0.001..=31_536_000.0).contains(&w) => Ok(()),
                _ => Err("must be a number of seconds from 0.001 to 31536000".into()),
            },
            "leaseSeconds" => match v.as_f64() {
                Some(l) if (0.1..=super::model::MAX_LEASE_SECONDS).contains(&l) => Ok(()),
                _ => Err("must be a number of seconds from 0.1 to 86400".into()),
            },
            "reservationSeconds" => match v.as_f64() {
                Some(l) if (0.1..=super::model::MAX_LEASE_SECONDS).contains(&l) => Ok(()),
                _ => Err("must be a number of seconds from 0.1 to 86400".into()),
            },
            "reservationExpiry" => one_of(v, &["charge", "release"]),
            "algorithm" => one_of(v, &["sliding_window", "token_bucket", "concurrency", "quota"]),
            "period" => one_of(v, &["day", "week", "month", "year"]),
            "timezone" => match v.as_str() {
                Some(z) if z.parse::<chrono_tz::Tz>().is_ok() => Ok(()),
                _ => Err("must be an IANA time zone name, e.g. \"Europe/Paris\" or \"UTC\"".into()),
            },
            "mode" => one_of(v, &["enforce", "log"]),
            "failMode" => one_of(v, &["open", "closed"]),
            "overLimit" => one_of(v, &["deny", "charge", "flag"]),
            "execution" => one_of(v, &["sync", "batched", "auto"]),
            "flushIntervalMs" => integer(v, 1, 60_000),
            "perEndpoint" => v
                .as_bool()
                .map(|_| ())
                .ok_or_else(|| "must be true or false".to_string()),
            "match" => check_match(v, &mut errors),
            "envoy" => serde_json::from_value::<super::EnvoyMatch>(v.clone())
                .map_err(|e| format!("must be {{domain, descriptors: [{{key, value?}}]}}: {e}"))
                .and_then(|m| m.validate()),
            "version" | "updatedAt" => Err("is set by the rules service, not by a PUT".into()),
            _ => Err(format!("unknown field; fields are {}", FIELDS.join(", "))),
        };
        if let Err(e) = check {
            errors.insert(k.clone(), e);
        }
    }
    let windowless = matches!(
        obj.get("algorithm").and_then(Value::as_str),
        Some("concurrency" | "quota")
    );
    for required in ["dimension", "limit", "windowSeconds"] {
        if required == "windowSeconds" && windowless {
            continue;
        }
        if !obj.contains_key(required) {
            errors.insert(required.into(), "is required".into());
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut obj = obj.clone();
    obj.insert("id".into(), Value::String(id.into()));
    let rule: Rule = match serde_json::from_value(Value::Object(obj)) {
        Ok(r) => r,
        Err(e) => {
            errors.insert("body".into(), e.to_string());
            return Err(errors);
        }
    };
    if let Err(e) = rule.check() {
        errors.insert("rule".into(), e.to_string());
        return Err(errors);
    }
    Ok(rule)
}

fn check_match(v: &Value, errors: &mut FieldErrors) -> Result<(), String> {
    let Some(m) = v.as_object() else {
        return Err("must be an object {endpoint?, tier?}".into());
    };
    for (k, v) in m {
        match k.as_str() {
            "endpoint" => match v.as_str() {
                Some(p) => {
                    if let Err(e) = validate_endpoint_pattern(p) {
                        errors.insert("match.endpoint".into(), e.to_string());
                    }
                }
                None => {
                    errors.insert("match.endpoint".into(), "must be a string".into());
                }
            },
            "tier" => {
                if !v.as_str().is_some_and(|t| !t.is_empty() && t.len() <= 64) {
                    errors.insert("match.tier".into(), "must be a string of 1 to 64 bytes".into());
                }
            }
            other => {
                errors.insert(
                    format!("match.{other}"),
                    "unknown field; fields are endpoint, tier".into(),
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_good_body_becomes_a_rule() {
        let r = rule_from_body(
            "api",
            br#"{"dimension":"user","match":{"endpoint":"/users/*/posts"},"limit":100,"windowSeconds":60,"execution":"batched","flushIntervalMs":50}"#,
        )
        .unwrap();
        assert_eq!(r.id, "api");
        assert_eq!(r.limit.get(), 100);
        assert_eq!(r.flush_interval_ms.unwrap().get(), 50);
    }

    #[test]
    fn every_bad_field_is_named() {
        let e = rule_from_body(
            "a b",
            br#"{"dimension":"planet","limit":0,"windowSeconds":-1,"mode":"maybe","colour":"red","match":{"endpoint":"api*","zone":1}}"#,
        )
        .unwrap_err();
        for field in [
            "id",
            "dimension",
            "limit",
            "windowSeconds",
            "mode",
            "colour",
            "match.endpoint",
            "match.zone",
        ] {
            assert!(e.contains_key(field), "{field} missing from {e:?}");
        }
        let e = rule_from_body("a", b"{}").unwrap_err();
        assert_eq!(e.len(), 3, "dimension, limit, windowSeconds are required: {e:?}");
        assert!(rule_from_body("a", b"not json").unwrap_err().contains_key("body"));
        let c = rule_from_body(
            "c",
            br#"{"dimension":"api_key","limit":4,"algorithm":"concurrency","leaseSeconds":30}"#,
        )
        .unwrap();
        assert_eq!(
            c.window_ms(),
            30_000,
            "a concurrency rule's lease time, no window needed"
        );
        let e = rule_from_body(
            "c",
            br#"{"dimension":"api_key","limit":4,"algorithm":"concurrency","windowSeconds":1,"leaseSeconds":0}"#,
        )
        .unwrap_err();
        assert!(e.contains_key("leaseSeconds"), "{e:?}");
        let e = rule_from_body(
            "c",
            br#"{"dimension":"api_key","limit":4,"algorithm":"concurrency","windowSeconds":1}"#,
        )
        .unwrap_err();
        assert!(e["rule"].contains("not windowSeconds"), "{e:?}");
        let q = rule_from_body(
            "q",
            br#"{"dimension":"api_key","limit":10000000,"algorithm":"quota","period":"month","timezone":"America/New_York"}"#,
        )
        .unwrap();
        assert_eq!(q.period, Some(crate::algo::Period::Month));
        let e = rule_from_body(
            "q",
            br#"{"dimension":"api_key","limit":5,"algorithm":"quota","period":"fortnight","timezone":"Mars/Olympus"}"#,
        )
        .unwrap_err();
        assert!(e.contains_key("period") && e.contains_key("timezone"), "{e:?}");
        let e = rule_from_body("q", br#"{"dimension":"api_key","limit":5,"algorithm":"quota"}"#).unwrap_err();
        assert!(e["rule"].contains("needs a period"), "{e:?}");
        let e =
            rule_from_body("a", br#"{"id":"b","dimension":"ip","limit":1,"windowSeconds":1}"#).unwrap_err();
        assert!(e.contains_key("id"));
    }
}
