"""Placement state shared by router replicas, in Redis (or Valkey): prefix owners and footprints.

One awaited round trip per request at most: an EVALSHA of the `claim` script (what it does:
routing/shared_view.py), bounded by `routing.shared_state_timeout_s`. A take-over, when the router
could not send to the shared owner, is written in the background and never awaited. When the store
is slow or down the router routes from its own state: each failure is counted
(`prefix_router_shared_state_errors_total{reason}`), `prefix_router_shared_state_up` drops to 0 with
one log line, calls stop until a background ping gets an answer again, and one line says so.

Keys, under NAMESPACE: `o:<block>` the block's owner; per backend `lru:<backend>` (a sorted set of
blocks by the shared clock's reading of their last use), `size:<backend>` (bytes of each block);
`used`, `count` and `cap` (hashes by backend: bytes placed, entries, capacity); `clock`. Scripts
touch keys they derive, so the store must be one Redis (6.2 or later) or Valkey, not a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_router.routing.picker import LEDGER_ENTRIES
from prefix_router.routing.shared_view import ClaimAnswer, ClaimRequest, Takeover, parse_answer

log = logging.getLogger("prefix_router.shared_state")

NAMESPACE = "prefix_router:"
ERROR_REASONS = ("timeout", "connection", "reply")
RECONNECT_INTERVAL_S = 1.0  # a store that is down is pinged this often
TIMEOUTS_TO_DOWN = 3  # timeouts in a row that count as down (one slow reply is only that request's)
MAX_CONNECTIONS = 64  # to the store, per replica; a request waits for one within its timeout

# Shared by both scripts: note blocks as just used by a backend, newest first (a prefix's shallow
# blocks end most recently used, so eviction trims prefixes from their tails), then evict its least
# recently used blocks while it holds more than its capacity, dropping the owners that name it.
_RECORD = """
local ns = ARGV[1]
-- Lists travel as one newline-joined argument each: 3 arguments for 30 blocks rather than 60 (the
-- client encodes each argument; redis-py's cost per argument is most of a claim's client time).
local function split(packed)
  local out = {}
  for item in string.gmatch(packed, '[^\\n]+') do out[#out + 1] = item end
  return out
end
local function record(backend, cap, max_entries, blocks, sizes)
  local n = #blocks
  local lru = ns .. 'lru:' .. backend
  local sz = ns .. 'size:' .. backend
  local now = redis.call('INCRBY', ns .. 'clock', n)
  local known = redis.call('ZMSCORE', lru, unpack(blocks))
  local scored, fresh, added = {}, {}, 0
  for i = 1, n do
    scored[2 * i - 1] = now - i + 1
    scored[2 * i] = blocks[i]
    if not known[i] then
      fresh[#fresh + 1] = blocks[i]
      fresh[#fresh + 1] = sizes[i]
      added = added + tonumber(sizes[i])
    end
  end
  redis.call('ZADD', lru, unpack(scored))
  if #fresh > 0 then redis.call('HSET', sz, unpack(fresh)) end
  local used = tonumber(redis.call('HGET', ns .. 'used', backend) or '0') + added
  local count = redis.call('ZCARD', lru)
  while count > 1 and (used > cap or count > max_entries) do
    local popped = redis.call('ZPOPMIN', lru)
    local block = popped[1]
    used = used - tonumber(redis.call('HGET', sz, block) or '0')
    redis.call('HDEL', sz, block)
    count = count - 1
    local owner_key = ns .. 'o:' .. block
    if redis.call('GET', owner_key) == backend then
      redis.call('DEL', owner_key)
    end
  end
  redis.call('HSET', ns .. 'used', backend, used)
  redis.call('HSET', ns .. 'count', backend, count)
end
local function capacity_of(backend)
  return tonumber(redis.call('HGET', ns .. 'cap', backend) or '') or 1099511627776
end
"""

# ARGV: namespace, proposed backend, its capacity (bytes), max entries, follow table, the blocks,
# their sizes, the listed backends. The reply is one newline-joined string: chosen, depth, followed,
# then bytes used, oldest use and entries of each listed backend.
CLAIM_SCRIPT = (
    _RECORD
    + """
local proposed = ARGV[2]
local max_entries = tonumber(ARGV[4])
local follow = ARGV[5]
local blocks, sizes, listed = split(ARGV[6]), split(ARGV[7]), split(ARGV[8])
local n, m = #blocks, #listed
local owner_keys = {}
for i = 1, n do owner_keys[i] = ns .. 'o:' .. blocks[i] end
redis.call('HSET', ns .. 'cap', proposed, ARGV[3])
local owners = redis.call('MGET', unpack(owner_keys))
local depth = 0
for i = n, 1, -1 do
  if owners[i] then depth = i; break end
end
local chosen, followed = proposed, 0
if depth > 0 and string.sub(follow, depth, depth) == '1' then
  chosen, followed = owners[depth], 1
end
local unowned = {}
for i = 1, n do
  if not owners[i] then
    unowned[#unowned + 1] = owner_keys[i]
    unowned[#unowned + 1] = chosen
  end
end
if #unowned > 0 then redis.call('MSET', unpack(unowned)) end
record(chosen, capacity_of(chosen), max_entries, blocks, sizes)
local reply = {chosen, depth, followed}
if m > 0 then
  local used = redis.call('HMGET', ns .. 'used', unpack(listed))
  local counts = redis.call('HMGET', ns .. 'count', unpack(listed))
  for j = 1, m do
    local count = tonumber(counts[j] or '0') or 0
    local oldest = -1
    if count > 0 then
      oldest = tonumber(redis.call('ZRANGE', ns .. 'lru:' .. listed[j], 0, 0, 'WITHSCORES')[2])
    end
    reply[#reply + 1] = tonumber(used[j] or '0') or 0
    reply[#reply + 1] = oldest
    reply[#reply + 1] = count
  end
end
return table.concat(reply, '\\n')
"""
)

# ARGV: namespace, source, target, target's capacity, max entries, after, the blocks, their sizes.
# Blocks past `after` that `source` owns move to `target`, out of the source's footprint; the
# target's footprint gets every block of the request.
TAKEOVER_SCRIPT = (
    _RECORD
    + """
local source, target = ARGV[2], ARGV[3]
local max_entries = tonumber(ARGV[5])
local after = tonumber(ARGV[6])
local blocks, sizes = split(ARGV[7]), split(ARGV[8])
local n = #blocks
redis.call('HSET', ns .. 'cap', target, ARGV[4])
local freed = 0
for i = after + 1, n do
  local owner_key = ns .. 'o:' .. blocks[i]
  if redis.call('GET', owner_key) == source then
    redis.call('SET', owner_key, target)
    if redis.call('ZREM', ns .. 'lru:' .. source, blocks[i]) == 1 then
      freed = freed + tonumber(redis.call('HGET', ns .. 'size:' .. source, blocks[i]) or '0')
      redis.call('HDEL', ns .. 'size:' .. source, blocks[i])
    end
  end
end
if freed > 0 then
  redis.call('HINCRBY', ns .. 'used', source, -freed)
  redis.call('HSET', ns .. 'count', source, redis.call('ZCARD', ns .. 'lru:' .. source))
end
record(target, tonumber(ARGV[4]), max_entries, blocks, sizes)
return 1
"""
)


def redacted(url: str) -> str:
    """The store's URL without its password, for log lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class SharedPlacement:
    """The store client: claim (awaited, bounded), take over (background), reconnect (background)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        registry: CollectorRegistry,
        *,
        namespace: str = NAMESPACE,
        max_entries: int = LEDGER_ENTRIES,
        reconnect_interval_s: float = RECONNECT_INTERVAL_S,
    ) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._namespace = namespace
        self._max_entries = str(max_entries)
        self._reconnect_interval_s = reconnect_interval_s
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=None,  # bounded by the caller's timeout
            socket_connect_timeout=max(timeout_s, 0.5),
            socket_timeout=None,
            retry=Retry(NoBackoff(), 0),  # a failed call is not repeated: the request routes locally
        )
        self._redis = Redis(connection_pool=pool)
        self._claim = self._redis.register_script(CLAIM_SCRIPT)
        self._takeover = self._redis.register_script(TAKEOVER_SCRIPT)
        self._up = False
        self._timeouts = 0
        self._said: bool | None = None  # the state the last log line announced
        self._reply_said = False
        self._pending: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.errors = Counter(
            "prefix_router_shared_state_errors",
            "Calls to the shared placement store that failed (the request routed from local state).",
            ["reason"],
            registry=registry,
        )
        for reason in ERROR_REASONS:
            self.errors.labels(reason)
        self.up_gauge = Gauge(
            "prefix_router_shared_state_up",
            "1 while the shared placement store answers, 0 while the router routes from local state.",
            registry=registry,
        )

    @property
    def up(self) -> bool:
        return self._up

    async def run(self) -> None:
        """Keep the store's state known: ping until it answers, then wait until a call fails."""
        while True:
            if not self._up:
                if await self._ping():
                    self._mark(True)
                else:
                    self._mark(False)
                    await asyncio.sleep(self._reconnect_interval_s)
                    continue
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        for task in list(self._pending):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()

    async def claim(self, request: ClaimRequest) -> ClaimAnswer | None:
        """The store's answer, or None (down, slow or wrong: the caller keeps its local decision)."""
        if not self._up:
            return None
        args: list[str | int] = [
            self._namespace,
            request.proposed,
            int(request.capacity_bytes),
            self._max_entries,
            request.follow,
            "\n".join(map(str, request.blocks)),
            "\n".join(map(str, request.sizes)),
            "\n".join(request.listed),
        ]
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await self._claim(args=args)
            answer = parse_answer(reply, request.listed)
        except Exception as exc:  # never fails a request: every failure routes locally
            self._failed(exc)
            return None
        self._timeouts = 0
        return answer

    def take_over(self, takeover: Takeover, request: ClaimRequest, target_capacity_bytes: float) -> None:
        """Write a take-over in the background (not awaited; a failure is counted like a claim's)."""
        if not self._up:
            return
        args: list[str | int] = [
            self._namespace,
            takeover.source,
            takeover.target,
            int(target_capacity_bytes),
            self._max_entries,
            takeover.after,
            "\n".join(map(str, request.blocks)),
            "\n".join(map(str, request.sizes)),
        ]
        task = asyncio.get_running_loop().create_task(self._write_takeover(args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write_takeover(self, args: Sequence[str | int]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._takeover(args=list(args))
        except Exception as exc:
            self._failed(exc)

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(max(self._timeout_s, 0.5)):
                await self._redis.ping()
        except Exception as exc:
            self._count(exc)
            return False
        return True

    def _failed(self, exc: BaseException) -> None:
        reason = self._count(exc)
        if reason == "reply":
            # The store answered, but not as the script should (an old server, a full memory): that
            # request routes locally; said once, as it would be said again for every request.
            if not self._reply_said:
                self._reply_said = True
                log.warning("shared placement state answered with an error (%s: %s)", type(exc).__name__, exc)
            return
        if reason == "timeout":
            self._timeouts += 1
            if self._timeouts < TIMEOUTS_TO_DOWN:
                return
        self._mark(False, exc)
        self._wake.set()

    def _count(self, exc: BaseException) -> str:
        if isinstance(exc, TimeoutError | RedisTimeoutError):
            reason = "timeout"
        elif isinstance(exc, RedisConnectionError | OSError):
            reason = "connection"
        else:
            reason = "reply"
        self.errors.labels(reason).inc()
        return reason

    def _mark(self, up: bool, exc: BaseException | None = None) -> None:
        self._up = up
        self._timeouts = 0
        self.up_gauge.set(1 if up else 0)
        if self._said is up:
            return  # one line per transition, not per request
        if up:
            log.info("shared placement state at %s is up: replicas share prefix owners", redacted(self._url))
        else:
            why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
            log.warning(
                "shared placement state at %s is down%s: routing from local state",
                redacted(self._url),
                why,
            )
        self._said = up
