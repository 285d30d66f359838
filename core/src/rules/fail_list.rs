//! The rules that deny while the agent is away, as the agent tells its SDKs (protocol version 2's
//! FailModeList): every enforced rule with `failMode = "closed"`, as many as one frame holds.

use floodgate_protocol::{ClosedRule, FailModeList, ListedDimension, LIST_HEAD, MAX_ATTRIBUTE, MAX_FRAME};

use super::{Dimension, FailMode, RuleSet};

/// Bytes of a frame before its body: length prefix, version, kind, request id.
const FRAME_HEAD: usize = 4 + 1 + 1 + 4;

/// The list for `rules`; `truncated` when the rules past the last listed one would not fit a frame.
pub fn fail_mode_list(rules: &RuleSet) -> FailModeList {
    let mut list = FailModeList {
        rules_version: rules.version(),
        ..FailModeList::default()
    };
    let mut size = FRAME_HEAD + LIST_HEAD;
    for rule in rules
        .iter()
        .filter(|r| r.fail_mode == FailMode::Closed && r.enforced())
    {
        let tier = rule.matches.tier.clone().unwrap_or_default();
        // A tier no attribute can carry (over 256 bytes, or empty: an empty attribute is absent)
        // never matches an attribute check: the rule is listed for the item checks that name it,
        // and matches no attributes, as in the agent ("" on the list would mean every tier).
        let unmatchable = tier.len() > MAX_ATTRIBUTE || rule.matches.tier.as_deref() == Some("");
        let dimension = match rule.dimension {
            _ if unmatchable => ListedDimension::Descriptor,
            Dimension::User => ListedDimension::User,
            Dimension::ApiKey => ListedDimension::ApiKey,
            Dimension::Ip => ListedDimension::Ip,
            Dimension::Descriptor => ListedDimension::Descriptor,
        };
        let entry = ClosedRule {
            rule_id: rule.id.as_str().into(),
            dimension,
            endpoint: rule.matches.endpoint.clone().unwrap_or_default(),
            tier: if unmatchable { String::new() } else { tier },
            limit: rule.display_limit(),
        };
        size += entry.encoded_len();
        if size > MAX_FRAME || list.rules.len() == usize::from(u16::MAX) {
            list.truncated = true;
            break;
        }
        list.rules.push(entry);
    }
    list
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_protocol::{Body, Frame};

    fn rules(n: usize, endpoint_len: usize) -> RuleSet {
        let mut text = String::new();
        for i in 0..n {
            text.push_str(&format!(
                "[[rules]]\nid = \"closed-{i}\"\ndimension = \"ip\"\nlimit = 5\nwindowSeconds = 60\n\
                 failMode = \"closed\"\nmatch = {{ endpoint = \"/{}\" }}\n",
                "e".repeat(endpoint_len - 1)
            ));
        }
        text.push_str(
            "[[rules]]\nid = \"open\"\ndimension = \"ip\"\nlimit = 5\nwindowSeconds = 60\n\
             [[rules]]\nid = \"dry\"\ndimension = \"user\"\nlimit = 5\nwindowSeconds = 60\n\
             failMode = \"closed\"\nmode = \"log\"\n",
        );
        RuleSet::parse(&text).unwrap()
    }

    #[test]
    fn lists_enforced_closed_rules_only_in_order() {
        let list = fail_mode_list(&rules(2, 6));
        let ids: Vec<&str> = list.rules.iter().map(|r| r.rule_id.as_str()).collect();
        assert_eq!(ids, ["closed-0", "closed-1"]);
        assert!(!list.truncated);
        assert_eq!(list.rules[0].endpoint, "/eeeee");
        assert_eq!(list.rules[0].dimension, ListedDimension::Ip);
        assert_eq!(list.rules[0].limit, 5);
    }

    #[test]
    fn an_empty_tier_matches_no_attributes_on_the_list_either() {
        let set = RuleSet::parse(
            "[[rules]]\nid = \"t\"\ndimension = \"ip\"\nlimit = 5\nwindowSeconds = 60\n\
             failMode = \"closed\"\nmatch = { tier = \"\" }\n",
        )
        .unwrap();
        let list = fail_mode_list(&set);
        assert_eq!(list.rules[0].dimension, ListedDimension::Descriptor);
    }

    #[test]
    fn a_list_too_long_for_a_frame_is_a_truncated_prefix_that_still_encodes() {
        let list = fail_mode_list(&rules(300, 256));
        assert!(list.truncated);
        assert!(
            list.rules.len() > 100 && list.rules.len() < 300,
            "{}",
            list.rules.len()
        );
        let bytes = Frame::new(1, Body::FailModeList(list)).to_bytes().unwrap();
        assert!(bytes.len() <= MAX_FRAME);
    }
}
