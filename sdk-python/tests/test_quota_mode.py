"""Quota mode (protocol version 6) in both clients, against real agents on the embedded store and on
Redis: a rule with ``overLimit = "flag"`` lets a request past its limit through, flagged over quota
(``Decision.over_quota``, ``over_quota_rules``, the item's verdict) and counted nowhere, as items and
as attributes; in a check naming an enforced rule too, that rule still decides and counts, and a
check it refuses still names the flagged rule."""

from __future__ import annotations

import pytest
from conftest import unique
from rules import QUOTA_RULES
from test_leases import either


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_past_its_limit_a_flag_rule_lets_through_flagged(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(QUOTA_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        assert c.protocol_version == 6
        key = unique("user")
        first = c.allow(key, "premium")
        assert first.from_agent and first.allowed and (first.limit, first.remaining) == (1, 0), first
        assert not first.over_quota and first.over_quota_rules == [] and not first.items[0].over_quota
        # Past the limit: allowed all the same, flagged, nothing to wait for.
        for _ in range(2):
            d = c.allow(key, "premium")
            assert d.from_agent and d.allowed and d.retry_after_ms is None, d
            assert d.over_quota and d.over_quota_rules == ["premium"], d
            [item] = d.items
            assert item.over_quota and item.verdict.over_quota and item.verdict.allowed and item.verdict.remaining == 0
        # Counted nowhere: another key is untouched, and a peek sees the one unit the first took.
        other = c.allow(unique("user"), "premium")
        assert other.allowed and not other.over_quota, other
        assert c.peek(key, "premium", 0).remaining == 0

        # As attributes: the rule matches a user on any endpoint.
        user = unique("u")
        first = c.check_attributes(endpoint="/v1/chat", user=user)
        assert first.allowed and not first.over_quota and [i.rule_id for i in first.items] == ["premium"], first
        second = c.check_attributes(endpoint="/v1/chat", user=user)
        assert second.allowed and second.over_quota and second.over_quota_rules == ["premium"], second


def test_an_enforced_rule_in_the_same_check_still_decides(make_agent, store, kind: str) -> None:  # noqa: ANN001
    agent = make_agent(QUOTA_RULES, redis=store)
    with either(kind, agent.socket, timeout=2.0) as c:
        key = unique("user")
        both = [(key, "premium"), (key, "strict")]
        d = c.check(both)
        assert d.allowed and not d.over_quota, d
        # premium is past its limit, strict (2) is not: allowed, flagged, strict counting its second.
        d = c.check(both)
        assert d.allowed and d.over_quota_rules == ["premium"], d
        assert {i.rule_id: (i.over_quota, i.verdict.remaining) for i in d.items} == {
            "premium": (True, 0),
            "strict": (False, 0),
        }
        # strict is spent: it refuses the check; the flagged item still says it was past its quota.
        d = c.check(both)
        assert not d.allowed and d.retry_after_ms is not None and d.retry_after_ms > 0, d
        assert d.over_quota_rules == ["premium"]
        assert {i.rule_id: (i.verdict.allowed, i.over_quota) for i in d.items} == {
            "premium": (True, True),
            "strict": (False, False),
        }
