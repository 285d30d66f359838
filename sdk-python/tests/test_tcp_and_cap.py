"""The frames over TCP (`tcp://host:port`, an agent's --listen-tcp), and the agent's connection cap:
past it a new connection gets Error 7 as its first frame and is closed, which a client takes as a
refused handshake (answers by its policy, keeps retrying)."""

from __future__ import annotations

import asyncio

import pytest
from conftest import eventually, free_port, unique
from rules import CLIENT_RULES

from floodgate import AsyncClient, Client, Degraded


def test_both_clients_speak_to_an_agent_over_tcp(make_agent) -> None:  # noqa: ANN001
    port = free_port()
    agent = make_agent(CLIENT_RULES, args=["--listen-tcp", f"127.0.0.1:{port}"])
    url = f"tcp://127.0.0.1:{port}"
    key = unique("user")
    with Client(url, timeout=2.0) as c:
        eventually("the agent listens on TCP", lambda: c.is_connected())
        d = c.allow(key, "r")
        assert d.from_agent and (d.limit, d.remaining) == (3, 2)

    async def main() -> None:
        c = await AsyncClient.connect(url, timeout=2.0)
        d = await c.allow(key, "r")
        assert d.from_agent and d.remaining == 1, "the same agent, the same key"
        await c.close()

    asyncio.run(main())
    assert agent.proc.poll() is None


def test_a_tcp_address_needs_a_port() -> None:
    with pytest.raises(ValueError):
        Client("tcp://127.0.0.1")


def test_past_the_agents_connection_cap_a_client_answers_by_policy(make_agent) -> None:  # noqa: ANN001
    agent = make_agent(CLIENT_RULES, args=["--max-connections", "1"])
    first = Client(agent.socket, timeout=2.0, reconnect_max=0.05)
    second = None
    try:
        # The readiness probe's connection may hold the one slot for a moment: wait for ours.
        eventually("the first client holds the one connection", first.is_connected)
        assert first.allow(unique("u"), "r").from_agent
        second = Client(agent.socket, timeout=2.0, reconnect_max=0.05)
        d = second.allow(unique("u"), "r")
        assert d.allowed and d.degraded is Degraded.UNAVAILABLE and not second.is_connected()
        assert second.stats().connects == 0
        # The slot freed, the second client gets in by itself.
        first.close()
        eventually("the second client connects once the slot is free", second.is_connected)
        assert second.allow(unique("u"), "r").from_agent
    finally:
        first.close()
        if second is not None:
            second.close()
