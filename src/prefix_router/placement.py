"""Where one attempt of a request goes, and what it holds while it is there.

choose (the routing policy's pick; with replicas sharing placements, the shared store's claim) →
capacity wait (every backend at max_inflight, or the one holding the request's prefix while no other
is clearly less busy: a bounded FIFO, woken by released leases and new load figures) → prefill
hold (another request is computing this prefix on the chosen backend: wait, bounded, for its first
byte) → a `Placement`: the backend, the decision, the lease on the backend and the claim
on the blocks this attempt prefills, given back together by one idempotent `release()`.

Knows no HTTP: whoever sends the request (the relay; a front end that only places) reports the answer
back through the Placement, and the waits are reported through `Waits`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from prefix_router.errors import NoBackend, Overloaded
from prefix_router.fleet.backends import BackendSet
from prefix_router.fleet.models import ModelDirectory
from prefix_router.routing.decision import Branch, Candidates, Decision
from prefix_router.routing.keys import RoutingKey
from prefix_router.routing.load import Lease
from prefix_router.routing.picker import FootprintHold, Picker
from prefix_router.routing.ring import HashRing
from prefix_router.routing.shared_view import (
    ClaimAnswer,
    ClaimRequest,
    Takeover,
    after_prefill,
    claim_request,
    followed_history,
    resolve,
    stale_follow,
)
from prefix_router.waiters import wake_first_taker


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    max_inflight: int = 32  # per backend: over it a request waits for capacity
    queue_max: int = 64  # requests that may wait for capacity at once
    queue_timeout_s: float = 0.5  # how long one waits for capacity before Overloaded
    prefill_wait_s: float = 5.0  # how long one waits for another's prefill of its prefix (0: never)


class Waits(Protocol):
    """Where the waits before a request is sent are reported (the router's metrics)."""

    def waited(self, reason: str, seconds: float) -> None: ...

    def prefill_waited(self, outcome: str, seconds: float) -> None: ...


class SharedStore(Protocol):
    """The shared placement store as placement uses it (fleet/shared_state.py's SharedPlacement)."""

    @property
    def up(self) -> bool: ...

    @property
    def can_wait(self) -> bool: ...

    def new_mark(self) -> str: ...

    async def claim(self, request: ClaimRequest) -> ClaimAnswer | None: ...

    def take_over(self, takeover: Takeover, request: ClaimRequest, target_capacity_bytes: float) -> None: ...

    def counts_moved(self) -> None: ...

    def waiting_on(self, backend_id: str, change: int) -> None: ...

    def touch(self, request: ClaimRequest, backend_id: str, capacity_bytes: float) -> None: ...

    def prefilled(self, mark: str, request: ClaimRequest, backend_id: str) -> None: ...

    def prompt_taken(self, prompt_end: int, backend_id: str) -> None: ...

    def unpin(self, backend_id: str, request: ClaimRequest) -> None: ...

    async def wait_prefilled(self, mark: str, timeout_s: float) -> tuple[str, str] | None: ...


class SharedClaim:
    """What one attempt's claim left in the shared store until it ends: its blocks pinned on the backend
    the request goes to (where the store placed them, or a take-over moved them), let go of once, when
    the attempt ends; and, when it `marked` them pending, its prefill's end, said once, at the first
    byte or at the attempt's end, as a PrefillHold's."""

    __slots__ = ("_mark", "_pinned", "_request", "_said", "_store", "backend_id")

    def __init__(self, store: SharedStore, request: ClaimRequest, backend_id: str, marked: bool) -> None:
        self._store = store
        self._request = request
        self._mark = request.mark if marked else ""
        self.backend_id = backend_id
        self._said = not marked
        self._pinned = True

    def moved(self, backend_id: str) -> None:
        """A take-over moved the claim's blocks, and their pins, to where the request now goes."""
        self.backend_id = backend_id

    def prefill_ended(self) -> None:
        if self._said:
            return
        self._said = True
        self._store.prefilled(self._mark, self._request, self.backend_id)

    def release(self) -> None:
        self.prefill_ended()
        if self._pinned:
            self._pinned = False
            self._store.unpin(self.backend_id, self._request)


class CapacityWaiters:
    """A bounded FIFO of requests waiting for capacity: on any backend (every one is at
    max_inflight), or on the one backend that holds their prefix (`for_backend`)."""

    __slots__ = ("_max", "_waiters")

    def __init__(self, max_waiting: int) -> None:
        self._max = max_waiting
        # (the future a release resolves with the backend it freed, the backend waited for or None
        # for any); a waiter that gave up stays until a wake-up passes it or its own wait removes it.
        self._waiters: deque[tuple[asyncio.Future[str], str | None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float, for_backend: str | None = None) -> str | None:
        """Wait for a release: the backend it freed ('' when every waiter was woken); None at once
        when the queue is full, or after the timeout."""
        if len(self._waiters) >= self._max or timeout_s <= 0:
            return None
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        entry = (fut, for_backend)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            return None
        finally:
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):  # a wake-up already took it
                self._waiters.remove(entry)

    def wake_all(self) -> None:
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_result("")

    def wake_one(self, freed: str, any_may_take: bool = True) -> None:
        """A request on `freed` ended: wake the first waiter for it or for any backend; when none
        waits for those and `any_may_take` (the backend is clearly less busy now), the first waiter
        for another backend, which will go there rather than wait on."""
        waiters = self._waiters
        if not wake_first_taker(waiters, lambda wish: wish is None or wish == freed, freed) and any_may_take:
            wake_first_taker(waiters, lambda wish: True, freed)


class PrefillHold:
    """One attempt's claim on the blocks it is prefilling (routing/prefill.py); requests for them wait
    on it. Released exactly once, at the first byte or when the attempt ends, whichever comes first."""

    __slots__ = ("_holds", "_released", "ticket")

    def __init__(self, holds: PrefillHolds, ticket: int) -> None:
        self._holds = holds
        self.ticket = ticket
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._holds._end(self.ticket)


class PrefillHolds:
    """The prefill holds open now: the picker's pending blocks, and one event per hold that wakes
    whoever waits on it when it is released."""

    __slots__ = ("_events", "_picker")

    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._events: dict[int, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._events)

    def claim(self, key: RoutingKey, backend_id: str) -> PrefillHold | None:
        """A hold on what this request will prefill there; None when it prefills nothing new (not
        streaming, no blocks, or all of them claimed or known already)."""
        ticket = self._picker.prefill_started(key, backend_id)
        if ticket is None:
            return None
        self._events[ticket] = asyncio.Event()
        return PrefillHold(self, ticket)

    async def wait(self, ticket: int, timeout_s: float) -> str | None:
        """'ready' or 'timeout'; None when the hold is already released (nothing to wait for)."""
        event = self._events.get(ticket)
        if event is None:
            return None
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return "timeout"
        return "ready"

    def _end(self, ticket: int) -> None:
        event = self._events.pop(ticket, None)
        if event is None:
            return
        event.set()
        self._picker.prefill_done(ticket)


class Placement:
    """One attempt's place: the backend, the policy's decision and the branch recorded for it, the
    lease on the backend and the prefill hold. `release()` gives back both, once, however often it is
    called; every exit path of the attempt calls it."""

    __slots__ = (
        "_claim",
        "_footprint",
        "_hold",
        "_key",
        "_lease",
        "_placer",
        "_released",
        "backend_id",
        "branch",
        "decision",
    )

    def __init__(
        self,
        placer: Placer,
        key: RoutingKey,
        decision: Decision,
        branch: Branch,
        lease: Lease,
        hold: PrefillHold | None,
        claim: SharedClaim | None = None,
        footprint: FootprintHold | None = None,
    ) -> None:
        self._placer = placer
        self._key = key
        self._footprint = footprint
        self.decision = decision
        self.backend_id = decision.backend_id
        self.branch = branch
        self._lease = lease
        self._hold = hold
        self._claim = claim
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def prefill(self) -> PrefillHold | None:
        return self._hold

    def answered(self) -> None:
        """The backend's answer began well: the prefix index learns where these blocks are."""
        self._placer._answered(self._key, self.backend_id)

    def first_byte(self) -> None:
        """The answer's first byte came: the prefix is cached there now, whoever waits for it may go."""
        if self._hold is not None:
            self._hold.release()
        if self._claim is not None:
            self._claim.prefill_ended()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._hold is not None:
            self._hold.release()
        if self._claim is not None:
            self._claim.release()
        self._placer._picker.ended(self._footprint)
        self._placer._lease_ended(self._lease)


class Placer:
    """Places attempts: the policy's pick (via the Picker) within max_inflight, the shared claim, the
    capacity queue and the prefill holds. One per router; no I/O but the shared store's claim."""

    __slots__ = (
        "_backends",
        "_config",
        "_holds",
        "_models",
        "_picker",
        "_rng",
        "_shared",
        "_waiters",
        "_waits",
    )

    def __init__(
        self,
        config: PlacementConfig,
        backends: BackendSet,
        picker: Picker,
        waits: Waits,
        rng: random.Random | None = None,
        models: ModelDirectory | None = None,
        shared: SharedStore | None = None,
    ) -> None:
        self._config = config
        self._backends = backends
        self._picker = picker
        self._waits = waits
        self._rng = rng or random.Random()
        self._models = models
        self._shared = shared
        self._waiters = CapacityWaiters(config.queue_max)
        self._holds = PrefillHolds(picker) if config.prefill_wait_s > 0 else None

    @property
    def waiting(self) -> int:
        """Requests in the capacity queue now."""
        return len(self._waiters)

    @property
    def holds(self) -> PrefillHolds | None:
        return self._holds

    def capacity_changed(self) -> None:
        """Something other than a local release may have freed capacity: let waiters look again."""
        self._waiters.wake_all()

    async def place(
        self, key: RoutingKey, exclude: Collection[str] = (), pin: str | None = None
    ) -> Placement:
        """A place for one attempt, on a backend not in `exclude` (the ones tried already; a retry
        then records the RETRY branch). With `pin`, only that backend (it stored what the request
        names). Raises NoBackend, Overloaded (capacity wait timed out), ModelNotFound."""
        decision, claim = await self._choose(key, exclude, pin)
        backend = decision.backend_id
        # Nothing awaits from here to the return: a cancelled request cannot leak the lease or hold.
        lease = self._backends.load.acquire(backend)
        footprint = self._picker.chosen(key, backend)
        hold = self._holds.claim(key, backend) if self._holds is not None else None
        branch = Branch.RETRY if exclude else decision.branch
        return Placement(self, key, decision, branch, lease, hold, claim, footprint)

    def settle_key(self, key: RoutingKey) -> RoutingKey:
        """The key to place every attempt of this request by (Picker.settle_key); once a request."""
        if not self._picker.counts_preambles:
            return key
        return self._picker.settle_key(key, len(self._scope(key, self._backends.candidates)[1].ids))

    def knows_model(self, model: str | None) -> bool:
        """A model name the fleet's listings (or the adapter configuration) name; False without them."""
        return self._models is not None and self._models.is_known(model)

    def has_other(self, key: RoutingKey, tried: Collection[str], pin: str | None = None) -> bool:
        """May a backend not in `tried` take this request (a pinned one has only its pin)?"""
        if pin is not None:
            return pin not in tried and self._backends.get(pin) is not None
        members = self._scope(key, self._backends.candidates)[1].members
        return any(b not in tried for b in members)

    def _scope(self, key: RoutingKey, fleet: Candidates) -> tuple[HashRing, Candidates]:
        """The ring and candidates of the key's model (the whole fleet's without model routing)."""
        route = self._models.route(key.model) if self._models is not None else None
        if route is None:
            return self._backends.ring, fleet
        return route.ring, route.narrow(fleet)

    async def _choose(
        self, key: RoutingKey, exclude: Collection[str], pin: str | None
    ) -> tuple[Decision, SharedClaim | None]:
        """A decision within the bound, waiting (bounded) while every backend is at max_inflight,
        and (bounded) while another request prefills this one's prefix on the chosen backend; with
        the shared store, what its claim left there until the attempt ends."""
        config = self._config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.queue_timeout_s
        wait = self._holds is not None and not exclude
        # Wait for a full backend that holds the prefix rather than spill to one as busy, until the
        # capacity wait's deadline; then any backend with room.
        hold = pin is None and not exclude
        queued_s = 0.0  # time spent in the capacity queue, observed once per request
        reason = "capacity"
        freed = ""  # the backend whose release woke this request, while it has not used it
        while True:
            if pin is not None:
                # The backend that stored the response named: no other one could answer.
                present = pin not in exclude and self._backends.get(pin) is not None
                decision = Decision(pin, Branch.AFFINITY) if present else None
            else:
                ring, candidates = self._scope(key, self._backends.candidates_now(self._rng))
                decision = self._picker.pick(
                    key, ring, candidates, self._backends.load, exclude, wait=wait, hold=hold
                )
            if decision is None:
                raise NoBackend("no healthy backend is available")
            if decision.wait_for is not None:
                wait = False  # once: after it, the index knows where the prefix went
                await self._wait_for_prefill(decision.wait_for, decision.backend_id)
                continue
            load = self._backends.load
            if load.load(decision.backend_id) < config.max_inflight:
                claim: SharedClaim | None = None
                if pin is None and self._shared is not None and not exclude and key.blocks:
                    decision, claim = await self._share(key, decision, ring, candidates)
                if load.load(decision.backend_id) < config.max_inflight:
                    if queued_s:
                        self._waits.waited(reason, queued_s)
                    return decision, claim
                # The fleet's counts of this moment put every choice at max_inflight: wait.
                if claim is not None:
                    claim.release()
            owner = decision.backend_id if decision.wait_owner else None
            if owner is not None:
                reason = "owner"
                if freed and load.load(freed) < config.max_inflight:
                    # Woken by a slot this request does not take (it waits for its owner): the
                    # next waiter that would take it goes, or the wake-up is lost on this one.
                    self._freed(freed)
            left = deadline - loop.time()
            began = time.perf_counter()
            woken = await self._waiters.wait(left, owner)
            queued_s += time.perf_counter() - began
            freed = woken or ""
            if woken is None:
                if hold:
                    hold = False  # no room on its owner in time (or no place in the queue): any
                    continue  # backend with room now
                self._waits.waited(reason, queued_s)
                raise Overloaded(
                    f"every backend is at its limit of {config.max_inflight} requests in flight",
                    retry_after_s=1,
                )

    async def _share(
        self, key: RoutingKey, local: Decision, ring: HashRing, candidates: Candidates
    ) -> tuple[Decision, SharedClaim | None]:
        """The decision every replica agrees on (routing/shared_view.py): one bounded round trip to
        the shared store; while it is slow or down, the local decision. Then, when another replica
        is prefilling the prefix it follows there, the bounded wait for that prefill's end."""
        shared = self._shared
        assert shared is not None
        load = self._backends.load
        if not shared.up:
            self._forget_peers()
            return local, None
        picker = self._picker
        holds = self._holds is not None
        request = claim_request(
            key,
            local,
            picker,
            ring,
            shared.new_mark() if holds else "",
            holds and shared.can_wait,
            candidates,
            load,
        )
        answer = await shared.claim(request)
        if answer is None:
            self._forget_peers()
            return local, None
        load.set_peers(answer.peers)
        picker.shared_held(answer.peers_held)
        picker.shared_footprints(answer.figures_before())
        if stale_follow(local, answer):
            picker.forget_placed(key, local.backend_id, answer.depth)
        full = answer.full
        history = answer.chosen if followed_history(request, answer) else None

        def follows(backend_id: str) -> bool:
            # An owner the store's count of the fleet puts at the limit is full, whatever this
            # replica's own view says: every replica must see it so.
            if backend_id in full:
                return False
            if backend_id == history:
                return picker.may_follow_history(backend_id, key, candidates, load)
            return picker.may_follow(backend_id, candidates, load)

        resolution = resolve(
            local,
            answer,
            candidates.members,
            follows,
            lambda: picker.pick(key, ring, candidates, load),
            picker.owner_rank,
            placed=bool(request.room),
        )
        if answer.added and resolution.takeover is None:  # else the take-over moves those bytes
            picker.shared_footprints(answer.figures)
        if resolution.takeover is not None:
            shared.take_over(resolution.takeover, request, request.capacity_bytes)
        decision = resolution.decision
        if decision.backend_id != answer.counted_on:
            shared.counts_moved()
        # Where the request goes is where the store has its blocks: the claim's choice, or the
        # take-over's target.
        claim = SharedClaim(shared, request, decision.backend_id, answer.marked)
        if not resolution.wait_for:
            return decision, claim
        # Nothing is held yet (no lease, no hold): a cancelled wait lets go of the claim.
        # While it waits, the request is counted where it will go: every replica's waiters for that
        # prefill go at once when it ends, and the fleet must see them coming.
        shared.waiting_on(decision.backend_id, 1)
        try:
            began = time.perf_counter()
            ended = await shared.wait_prefilled(resolution.wait_for, self._config.prefill_wait_s)
        except BaseException:
            claim.release()
            raise
        finally:
            shared.waiting_on(decision.backend_id, -1)
        if ended is None:
            return decision, claim
        outcome, prefilled_on = ended
        self._waits.prefill_waited(outcome, time.perf_counter() - began)
        moved = after_prefill(decision, prefilled_on, candidates.members, follows)
        if moved is not decision:
            # What the claim gave the old choice goes where the request goes, and so does its count.
            takeover = Takeover(decision.backend_id, moved.backend_id, answer.depth)
            shared.take_over(takeover, request, request.capacity_bytes)
            shared.counts_moved()
            claim.moved(moved.backend_id)
        elif outcome == "ready" and picker.ledgers is not None:
            shared.touch(request, moved.backend_id, picker.ledgers.capacity(moved.backend_id))
        return moved, claim

    def _answered(self, key: RoutingKey, backend_id: str) -> None:
        """An answer began well there: the picker learns it, and the shared store who took a prompt
        too short to claim anything (the replica the next turn reaches follows it by that alone)."""
        self._picker.placed(key, backend_id)
        if self._shared is not None and self._picker.notes_prompt_end(key):
            self._shared.prompt_taken(key.prompt_end, backend_id)

    def _forget_peers(self) -> None:
        """No answer from the store: what it said of the other replicas (their requests in flight,
        the KV room those hold) is not known any more, and this replica routes on its own."""
        self._backends.load.clear_peers()
        self._picker.shared_held(())

    async def _wait_for_prefill(self, ticket: int, backend: str) -> None:
        """Held until the prefill on `backend` ends (bounded), counted there meanwhile: the request
        is bound to go there, though none of its blocks is placed yet."""
        assert self._holds is not None
        load = self._backends.load
        began = time.perf_counter()
        load.prefill_hold_began(backend)
        try:
            outcome = await self._holds.wait(ticket, self._config.prefill_wait_s)
        finally:
            load.prefill_hold_ended(backend)
        if outcome is not None:
            self._waits.prefill_waited(outcome, time.perf_counter() - began)

    def _lease_ended(self, lease: Lease) -> None:
        lease.release()
        backend = lease.backend_id
        self._backends.lease_ended(backend)
        self._freed(backend)

    def _freed(self, backend: str) -> None:
        """A slot on the backend is free: the first waiter that may take it goes."""
        if len(self._waiters):
            self._waiters.wake_one(backend, self._picker.may_spill_to(backend, self._backends.load))
