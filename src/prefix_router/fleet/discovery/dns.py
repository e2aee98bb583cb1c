"""DNS discovery: every A and AAAA record of a headless Service name is a backend, re-resolved on an
interval. A failed or empty lookup keeps the last known set: a DNS blip (timeout, SERVFAIL, a resolver
restart, a transient NXDOMAIN) must never empty the fleet. The cost of that choice is that scaling to
zero is not seen here; health checks eject backends that are really gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import dns.asyncresolver
import dns.resolver

from prefix_router.fleet.discovery.base import ApplyBackends, MembershipPublisher, backend_url

logger = logging.getLogger(__name__)

_RECORD_TYPES = ("A", "AAAA")


@dataclass(frozen=True, slots=True)
class DnsLookup:
    """One resolution: the backend URLs found, or why none can be trusted."""

    urls: frozenset[str]
    failure: str | None = None  # set when the lookup failed; `urls` is then empty and meaningless

    @property
    def usable(self) -> bool:
        return self.failure is None and bool(self.urls)


class DnsDiscovery:
    def __init__(
        self,
        name: str,
        port: int,
        *,
        scheme: str = "http",
        interval_s: float = 5.0,
        nameserver: str | None = None,
        nameserver_port: int = 53,
        timeout_s: float = 2.0,
        initial: Iterable[str] = (),
    ) -> None:
        self._name = name
        self._port = port
        self._scheme = scheme
        self._interval_s = interval_s
        self._nameserver = nameserver
        self._nameserver_port = nameserver_port
        self._timeout_s = timeout_s  # a dead resolver must not stall the loop for long
        self._initial = frozenset(initial)

    async def run(self, apply: ApplyBackends) -> None:
        publisher = MembershipPublisher(apply, "dns", self._initial)
        resolver: dns.asyncresolver.Resolver | None = None
        failing = 0  # consecutive lookups that could not be used
        while True:
            try:
                resolver = resolver or self._make_resolver()
            except Exception as exc:  # e.g. no /etc/resolv.conf: retried next interval
                lookup = DnsLookup(frozenset(), f"resolver configuration: {exc}")
            else:
                lookup = await self.lookup(resolver)
            if lookup.usable:
                if failing:
                    logger.info(
                        "dns discovery: %s resolves again after %d failed lookups", self._name, failing
                    )
                failing = 0
                publisher.publish(lookup.urls)
            else:
                failing += 1
                if failing == 1:  # once per outage, not once per interval
                    logger.warning(
                        "dns discovery: %s: %s; keeping the last %d backends",
                        self._name,
                        lookup.failure or "no A or AAAA records",
                        len(publisher.current),
                    )
            await asyncio.sleep(self._interval_s)

    async def lookup(self, resolver: dns.asyncresolver.Resolver) -> DnsLookup:
        """Both record types; a failure of either makes the whole lookup untrusted, so a timed-out AAAA
        query cannot silently drop every IPv6 backend."""
        answers = await asyncio.gather(
            *(self._query(resolver, record_type) for record_type in _RECORD_TYPES), return_exceptions=True
        )
        urls: set[str] = set()
        for record_type, answer in zip(_RECORD_TYPES, answers, strict=True):
            if isinstance(answer, dns.resolver.NXDOMAIN):
                continue  # the name does not exist: no records of this type
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer  # cancellation
                return DnsLookup(frozenset(), f"{record_type} lookup failed: {_describe(answer)}")
            urls.update(backend_url(self._scheme, address, self._port) for address in answer)
        return DnsLookup(frozenset(urls))

    async def _query(self, resolver: dns.asyncresolver.Resolver, record_type: str) -> list[str]:
        answer = await resolver.resolve(
            self._name, record_type, raise_on_no_answer=False, search=self._nameserver is None
        )
        if answer.rrset is None:
            return []
        return [rdata.address for rdata in answer.rrset]

    def _make_resolver(self) -> dns.asyncresolver.Resolver:
        # With an explicit nameserver, /etc/resolv.conf is not read at all (tests, or bypassing it);
        # otherwise its search list applies, so a short Service name resolves as it does in the pod.
        resolver = dns.asyncresolver.Resolver(configure=self._nameserver is None)
        if self._nameserver is not None:
            resolver.nameservers = [self._nameserver]
            resolver.port = self._nameserver_port
        # `lifetime` bounds the whole lookup; each server still gets dnspython's per-try timeout.
        resolver.lifetime = self._timeout_s
        resolver.timeout = min(resolver.timeout, self._timeout_s)
        return resolver


def _describe(exc: Exception) -> str:
    if isinstance(exc, dns.resolver.LifetimeTimeout):
        return "timed out"
    if isinstance(exc, dns.resolver.NoNameservers):
        return "no nameserver answered (SERVFAIL or refused)"
    return f"{type(exc).__name__}: {exc}"
