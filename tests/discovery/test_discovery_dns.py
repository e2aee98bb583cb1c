"""DNS discovery against a real DNS server on a loopback UDP port that answers from a mutable table."""

from __future__ import annotations

import logging

import pytest
from discovery_fakes import SERVICE_NAME, AppliedSets, FakeDnsServer, running

from prefix_router.fleet.backends import BackendSpec
from prefix_router.fleet.discovery import DnsDiscovery, build_discovery
from prefix_router.settings import DiscoveryMode, DiscoverySettings

from loopback import eventually


def make_discovery(server: FakeDnsServer, initial: tuple[str, ...] = ()) -> DnsDiscovery:
    return DnsDiscovery(
        SERVICE_NAME,
        8000,
        interval_s=0.05,
        nameserver="127.0.0.1",
        nameserver_port=server.port,
        timeout_s=0.2,
        initial=initial,
    )


async def wait_for_more_queries(server: FakeDnsServer, lookups: int) -> None:
    """Each lookup sends one A and one AAAA query, and the next starts only after the last ended."""
    target = server.queries + 2 * lookups + 2
    await eventually(lambda: server.queries >= target)


async def test_a_and_aaaa_records_become_backends_with_ipv6_bracketed(dns_server: FakeDnsServer) -> None:
    dns_server.records = {"A": ["192.0.2.10", "192.0.2.11"], "AAAA": ["2001:db8:0:0::1"]}
    applied = AppliedSets()
    async with running(make_discovery(dns_server), applied):
        await eventually(lambda: applied.last is not None)
    assert applied.last == {"http://192.0.2.10:8000", "http://192.0.2.11:8000", "http://[2001:db8::1]:8000"}


async def test_changed_records_are_applied_and_unchanged_ones_are_not(dns_server: FakeDnsServer) -> None:
    dns_server.records = {"A": ["192.0.2.10", "192.0.2.11"], "AAAA": []}
    applied = AppliedSets()
    async with running(make_discovery(dns_server), applied):
        await eventually(lambda: applied.last is not None)
        await wait_for_more_queries(dns_server, lookups=3)
        assert len(applied.calls) == 1, "the same answer must not be applied again"

        dns_server.records = {"A": ["192.0.2.11", "192.0.2.12"], "AAAA": ["2001:db8::7"]}
        await eventually(lambda: len(applied.calls) == 2)
        assert applied.last == {
            "http://192.0.2.11:8000",
            "http://192.0.2.12:8000",
            "http://[2001:db8::7]:8000",
        }

        dns_server.records = {"A": ["192.0.2.12"], "AAAA": []}
        await eventually(lambda: len(applied.calls) == 3)
        assert applied.last == {"http://192.0.2.12:8000"}


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param("servfail", id="servfail"),
        pytest.param("drop", id="server-stops-answering"),
        pytest.param("nxdomain", id="nxdomain"),
        pytest.param("empty", id="no-records"),
    ],
)
async def test_failed_or_empty_lookup_keeps_the_last_set(
    dns_server: FakeDnsServer, failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    dns_server.records = {"A": ["192.0.2.10"], "AAAA": ["2001:db8::1"]}
    applied = AppliedSets()
    caplog.set_level(logging.WARNING, logger="prefix_router.fleet.discovery.dns")
    async with running(make_discovery(dns_server), applied):
        await eventually(lambda: applied.last is not None)
        known = applied.last

        if failure == "empty":
            dns_server.records = {"A": [], "AAAA": []}
        else:
            dns_server.mode = failure
        await wait_for_more_queries(dns_server, lookups=3)
        assert applied.calls == [frozenset(known or ())], (
            "a DNS failure must never change (or empty) the fleet"
        )
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, "one warning per outage, not one per lookup"
        assert "keeping the last 2 backends" in warnings[0].getMessage()

        # Recovery: the next good answer is applied as usual.
        dns_server.mode = "answer"
        dns_server.records = {"A": ["192.0.2.20"], "AAAA": []}
        await eventually(lambda: len(applied.calls) == 2)
        assert applied.last == {"http://192.0.2.20:8000"}


async def test_first_answer_is_applied_even_when_equal_to_the_static_seed(dns_server: FakeDnsServer) -> None:
    dns_server.mode = "servfail"
    dns_server.records = {"A": ["192.0.2.10"], "AAAA": []}
    applied = AppliedSets()
    async with running(make_discovery(dns_server, initial=("http://192.0.2.10:8000",)), applied):
        await wait_for_more_queries(dns_server, lookups=2)
        assert applied.calls == [], "nothing is known yet: the app keeps its static list"
        dns_server.mode = "answer"
        await eventually(lambda: applied.last is not None)
        await wait_for_more_queries(dns_server, lookups=2)
    assert applied.calls == [frozenset({"http://192.0.2.10:8000"})]


async def test_build_discovery_takes_name_port_scheme_and_nameserver_from_settings(
    dns_server: FakeDnsServer,
) -> None:
    dns_server.records = {"A": ["192.0.2.30"], "AAAA": ["2001:db8::30"]}
    settings = DiscoverySettings(
        mode=DiscoveryMode.DNS,
        scheme="https",
        dns_name=SERVICE_NAME,
        dns_port=9443,
        dns_interval_s=0.05,
        dns_nameserver="127.0.0.1",
        dns_nameserver_port=dns_server.port,
    )
    discovery = build_discovery(settings, [])
    assert discovery is not None
    applied = AppliedSets()
    async with running(discovery, applied):
        await eventually(lambda: applied.last is not None)
    assert applied.last == {"https://192.0.2.30:9443", "https://[2001:db8::30]:9443"}


def test_static_mode_needs_no_discovery() -> None:
    static = [BackendSpec("http://127.0.0.1:8000")]
    assert build_discovery(DiscoverySettings(), static) is None
