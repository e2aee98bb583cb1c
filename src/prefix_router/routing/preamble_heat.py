"""How much of a replica's recent traffic each preamble (system prompt, tools) carries.

Stateless replicas place new prefixes by the ring, and the ring places whatever its key holds alike
on every replica. Keyed on the preamble alone, all requests behind one system prompt go to one
backend: right for a system prompt a few requests share (one backend computes it once, every replica
sends them there), wrong for one that starts much of the traffic (every new conversation would pile
onto one backend). Which of the two a preamble is, every replica can tell from its own share of the
traffic, since a load balancer spreads the same mix over them: the share of recent requests that
carried it, counted with exponential decay so that a change in the mix shows within a few half-lives.
Pure and synchronous: the picker observes each request once.
"""

from __future__ import annotations

# Requests over which a preamble's count halves: short enough that a new system prompt taking much of
# the traffic turns hot after a few dozen of its requests, long enough that one taking 1/32 of it does
# not look hot by chance (with 4 backends, hot is ~17 of the last ~93 requests, decayed alike; 1/32 of
# them is ~3).
HALF_LIFE_REQUESTS = 64
# Below this many (decayed) requests, about three recent ones, a preamble is cold whatever its share:
# a fresh replica's first requests all have a share of one. Over a replica's first few dozen requests
# a preamble a few requests share can still look hot by chance; hot is what replicas did before they
# kept cold preambles together, so that costs no more than before.
HOT_MIN_REQUESTS = 2.5
# Preambles remembered; the least recently seen is dropped first (a cold one by then).
PREAMBLE_ENTRIES = 4096


def hot_share(backends: int) -> float:
    """The share of the traffic above which a preamble is hot: three quarters of one backend's fair
    share. One backend takes all of a cold preamble's requests; up to that share they leave it room,
    within the default load bound (1.25x the mean), for the other keys the ring sends it."""
    return 0.75 / max(1, backends)


class PreambleHeat:
    """Decayed request counts per preamble ring hash, and the decayed total."""

    __slots__ = ("_counts", "_decay", "_entries", "_tick")

    def __init__(self, half_life: int = HALF_LIFE_REQUESTS, entries: int = PREAMBLE_ENTRIES) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._entries = entries
        self._tick = 0
        # preamble -> (its count right after its last request, that request's tick)
        self._counts: dict[int, tuple[float, int]] = {}

    def observe(self, preamble: int) -> None:
        """One more request; `preamble` is its preamble's ring hash (0: it has none to place by)."""
        self._tick += 1
        if not preamble:
            return
        counts = self._counts
        seen = counts.pop(preamble, None)
        count = 1.0 if seen is None else seen[0] * self._decay ** (self._tick - seen[1]) + 1.0
        counts[preamble] = (count, self._tick)  # re-inserted: the dict's order is the order last seen
        if len(counts) > self._entries:
            del counts[next(iter(counts))]

    def count(self, preamble: int) -> float:
        seen = self._counts.get(preamble)
        return 0.0 if seen is None else seen[0] * self._decay ** (self._tick - seen[1])

    def total(self) -> float:
        """All requests observed, decayed alike: the sum of decay**age over ticks 1..now."""
        d = self._decay
        return float((1.0 - d**self._tick) / (1.0 - d))

    def share(self, preamble: int) -> float:
        """The share of the recent traffic (decayed alike) that carried this preamble."""
        total = self.total()
        return self.count(preamble) / total if total > 0 else 0.0

    def is_hot(self, preamble: int, backends: int) -> bool:
        """Does this preamble carry more than `hot_share` of the recent traffic (and enough requests
        to tell)?"""
        count = self.count(preamble)
        return count >= HOT_MIN_REQUESTS and count >= hot_share(backends) * self.total()

    def __len__(self) -> int:
        return len(self._counts)
