"""Peek and charge against real agents, both clients, on the embedded store and on Redis: a peek
changes nothing, a charge commits past the limit and is never denied, a denied consume takes
nothing; as items (forms 0 and 2) and as attributes (forms 1 and 3)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

import pytest
from conftest import unique
from rules import MODE_RULES

from floodgate import AsyncClient, Client, Decision

# (items rule, the endpoint its attribute checks send): rules.MODE_RULES says why each window.
RULES = {"token_bucket": ("tb-5-per-min", "/modes-tb"), "sliding_window": ("sw-5", "/modes-sw")}


@pytest.fixture(params=["sync", "async"])
def calls(request: pytest.FixtureRequest, make_agent, store) -> Iterator[Callable[..., Decision]]:  # noqa: ANN001
    """``calls(method, *args, **kw)`` on a client of a fresh agent: the threaded one, or the asyncio
    one on an event loop of its own."""
    agent = make_agent(MODE_RULES, redis=store)
    if request.param == "sync":
        with Client(agent.socket, timeout=2.0) as client:
            yield lambda method, *a, **kw: getattr(client, method)(*a, **kw)
        return
    loop = asyncio.new_event_loop()
    aclient = loop.run_until_complete(AsyncClient.connect(agent.socket, timeout=2.0))

    def call(method: str, *a: Any, **kw: Any) -> Decision:
        return loop.run_until_complete(getattr(aclient, method)(*a, **kw))

    try:
        yield call
    finally:
        loop.run_until_complete(aclient.close())
        loop.close()


@pytest.mark.parametrize("algorithm", sorted(RULES))
def test_peek_changes_nothing_and_charge_goes_past_the_limit(calls, algorithm: str) -> None:  # noqa: ANN001
    rule, _ = RULES[algorithm]
    key = unique("user")
    d = calls("allow", key, rule, 3)
    assert d.from_agent and d.allowed and (d.limit, d.remaining) == (5, 2), d
    # A peek of cost 0, twice: allowed with 2 left, the second the same as the first.
    first = calls("peek", key, rule)
    assert first.from_agent and first.allowed and (first.limit, first.remaining) == (5, 2), first
    assert first.retry_after_ms is None
    second = calls("peek", key, rule)
    assert (second.allowed, second.remaining, second.reset_at_ms) == (True, 2, first.reset_at_ms)
    # A peek of 3 would not pass: denied, and when 3 could pass; still nothing taken.
    d = calls("peek", key, rule, 3)
    assert not d.allowed and d.remaining == 2 and d.retry_after_ms and d.retry_after_ms > 0, d
    # A charge of 10 with 2 left: committed all the same, never a rejection.
    d = calls("charge", key, rule, 10)
    assert d.from_agent and d.allowed and (d.limit, d.remaining) == (5, 0) and d.retry_after_ms is None, d
    denied = calls("allow", key, rule, 1)
    assert denied.from_agent and not denied.allowed and denied.remaining == 0, denied
    assert denied.retry_after_ms is not None and denied.retry_after_ms > 0
    if algorithm == "token_bucket":
        # 2 left less 10 is a debt of 8: one unit more is 9 × 12 s away, less the time since the
        # consume (under 12 s, or the remaining above would have moved).
        assert 96_000 < denied.retry_after_ms <= 108_000, denied
    # The denied consume took nothing: one unit is no further away than it said (it would be a
    # unit's worth further, 12 s on the bucket, had it been taken).
    d = calls("peek", key, rule, 1)
    assert not d.allowed and d.retry_after_ms is not None and d.retry_after_ms <= denied.retry_after_ms, d


@pytest.mark.parametrize("algorithm", sorted(RULES))
def test_attribute_checks_peek_and_charge(calls, algorithm: str) -> None:  # noqa: ANN001
    _, endpoint = RULES[algorithm]
    user = unique("u")

    def attributes(cost: int, mode: str = "consume") -> Decision:
        return calls("check_attributes", endpoint=endpoint, user=user, cost=cost, mode=mode)

    d = attributes(4)
    assert d.from_agent and d.allowed and (d.limit, d.remaining) == (5, 1), d
    for _ in range(2):
        d = attributes(0, "peek")
        assert d.allowed and d.remaining == 1, d
    d = attributes(3, "charge")
    assert d.allowed and d.remaining == 0 and [i.rule_id for i in d.items] == [RULES[algorithm][0]], d
    d = attributes(1)
    assert not d.allowed and d.retry_after_ms is not None and d.retry_after_ms > 0, d


def test_peeks_and_charges_stay_out_of_the_fallback_limit(tmp_path):
    """With the agent away and a per-process limit of 1, charges and peeks never take its token
    (a consume still does, and the second is denied)."""
    from floodgate import Client, ClientConfig, LocalLimit
    from floodgate.protocol import Item, ItemMode

    config = ClientConfig(fallback_limit=LocalLimit(limit=1, per=60.0), connect_timeout=0.05)
    client = Client(str(tmp_path / "nobody.sock"), config)
    try:
        for _ in range(3):
            assert client.charge("user:1", "r", 5).allowed
            assert client.check([Item("user:1", "r", 0, ItemMode.PEEK)]).allowed
        assert client.allow("user:1", "r", 1).allowed
        assert not client.allow("user:1", "r", 1).allowed
    finally:
        client.close()
