"""Placement state shared by router replicas, in Redis (or Valkey): prefix owners and footprints,
pending prefills and requests in flight.

One awaited round trip per request at most: an EVALSHA of the `claim` script (what it does:
routing/shared_view.py), bounded by `routing.shared_state_timeout_s`. A take-over, when the router
could not send to the shared owner, the end of a prefill this replica marked, the prefix a request
held for a prefill goes to (used now there), and who took a prompt too short to claim are written in
the background and never awaited. When the store is slow or down the router routes from its own state:
each failure is counted (`prefix_router_shared_state_errors_total{reason}`),
`prefix_router_shared_state_up` drops to 0 with one log line, calls stop until a background ping gets
an answer again, and one line says so.

Pending prefills: a claim marks the blocks its request prefills first (`p:<block>`, expiring after
`prefill_wait_s`, so a dead replica's marks go); the replica that prefills deletes them at the first
byte and PUBLISHes the mark on `prefilled`, which every replica subscribes to: a request another
replica holds back for that prefill is woken by it, and a lost subscription wakes every such request
(it is pinged while quiet, so one that dies without a word is found lost too).
Requests in flight: each claim carries this replica's counts (`ld:<replica>`, a hash that expires after
LOAD_TTL_S; the replicas seen are the set `replicas`), its own request counted where the script sends
it, and the requests whose claims are still awaiting their answer counted where their own claim's
script counted them (`cl:<replica>`, claim id to backend), or where they proposed while that script
has not run; the answer sums the others'. A request's end is written at once in the background (the
ends of one moment together), other changes with the next claim or by a background write when none
came for LOAD_FLUSH_S; a request that goes elsewhere than its claim counted it is written at once.
Pins: a claim pins the request's blocks on the backend it placed them on (a take-over moves them), and
eviction passes them over, as the engine keeps a running request's blocks; the request's end lets go
of them in that background write. Each expires after PIN_TTL_S, so a replica
gone leaves none. A claim the replica stopped waiting for is given up (`x:<replica>:<claim>`, and its
receipt `pc:<replica>:<claim>` says where it pinned): it pins nothing if it runs later, and its pins go
if it ran.

Keys, under NAMESPACE: `o:<block>` the block's owner, `end:<block>` whether a claim went on past
the last block of a prompt (gone with the owner); per backend `lru:<backend>` (a sorted set of
blocks by the shared clock's reading of their last use), `size:<backend>` (bytes of each block); `used`,
`count` and `cap` (hashes by backend: bytes placed, entries, capacity); `clock`; `p:<block>`, `e:<mark>`
(a prefill said ended), `w:<mark>` (requests held for it, per replica), `ld:<replica>`, `cl:<replica>`,
`replicas` as above; `t:<prompt end>` who took a prompt that filled no block (for its next turn,
expiring after PROMPT_TAKER_TTL_S); `pin:<backend>:<block>`, the requests in flight holding the block
there, `pc:` and `x:` (pins, above). Scripts touch keys they derive, so the store must be one Redis (6.2
or later) or Valkey, not a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefix_router.routing.footprint import FULL_SHARE
from prefix_router.routing.load import LoadTracker
from prefix_router.routing.picker import LEDGER_ENTRIES
from prefix_router.routing.shared_view import HELD, ClaimAnswer, ClaimRequest, Takeover, parse_answer

log = logging.getLogger("prefix_router.shared_state")

NAMESPACE = "prefix_router:"
ERROR_REASONS = ("timeout", "connection", "reply")
RECONNECT_INTERVAL_S = 1.0  # a store that is down is pinged this often
TIMEOUTS_TO_DOWN = 3  # timeouts in a row that count as down (one slow reply is only that request's)
MAX_CONNECTIONS = 64  # to the store, per replica; a request waits for one within its timeout
LOAD_TTL_S = 3.0  # a replica's in-flight counts outlive its last write by this much, then count as none
LOAD_FLUSH_S = 0.02  # counts changed and no claim carried them for this long: written in the background
ENDED_KEPT = 1024  # prefills whose end was heard, kept for a waiter whose claim answer comes after it
# A request's pins outlive its claim by this much at most: a replica that dies leaves none after it.
# A request that runs longer loses them, and its blocks age from its claim on, as they did unpinned.
PIN_TTL_S = 300.0
# A claim that pinned leaves a receipt of where for this long; a replica that gave up waiting for a
# claim (timed out) says so for as long: one that runs after that pins nothing, one that ran before
# is unpinned. A give-up later than this leaves the claim's pins to PIN_TTL_S.
CLAIM_RECEIPT_TTL_S = 10.0
# Who took a prompt that filled no block of the key, noted by the prompt's end for the next turn: a
# conversation back after longer is placed anew, as its cache has likely turned over by then.
PROMPT_TAKER_TTL_S = 600.0
BACKGROUND_TIMEOUT_S = 1.0  # at least, for calls no request waits on: a slow store may still take them
# The subscription quiet this long is pinged, and lost when the next quiet spell brings no answer: a
# connection that died without a word (a partition, a peer gone without a reset) would stay quiet,
# and the requests held for prefills whose end it would carry would wait out prefill_wait_s.
SUBSCRIPTION_PING_S = 1.0

# Shared by the scripts: note blocks as just used by a backend, newest first (a prefix's shallow
# blocks end most recently used, so eviction trims prefixes from their tails), then evict its least
# recently used blocks while it holds more than its capacity, dropping the owners that name it. A
# block pending a prefill (`p:<block>`) or pinned there by a request in flight (`pin:<backend>:<block>`)
# is not evicted: the engine holds a running request's blocks until it ends, and a claim that pushed
# them out would see room there that the engine does not have, and keep owners the engine evicted in
# their stead.
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
  local pinned = {}
  -- One entry always stays (a prompt larger than the whole cache leaves its head cached): a pinned
  -- one counts, as it stays too.
  while count > 0 and count + #pinned > 1 and (used > cap or count + #pinned > max_entries) do
    local block = redis.call('ZPOPMIN', lru)[1]
    count = count - 1
    if redis.call('EXISTS', ns .. 'p:' .. block, ns .. 'pin:' .. backend .. ':' .. block) > 0 then
      pinned[#pinned + 1] = block  -- being prefilled, or held by a request in flight: kept
    else
      used = used - tonumber(redis.call('HGET', sz, block) or '0')
      redis.call('HDEL', sz, block)
      local owner_key = ns .. 'o:' .. block
      if redis.call('GET', owner_key) == backend then
        redis.call('DEL', owner_key, ns .. 'end:' .. block)
      end
    end
  end
  -- Back as just used (below this request's own blocks, in their order), so the next evictions
  -- come to them only after the older blocks; in slices, as unpack() of a long list would overflow.
  local p = #pinned
  for first = 1, p, 1000 do
    local slice = {}
    for j = first, math.min(first + 999, p) do
      slice[#slice + 1] = now - n - (p - j)
      slice[#slice + 1] = pinned[j]
    end
    redis.call('ZADD', lru, unpack(slice))
  end
  count = count + p
  redis.call('HSET', ns .. 'used', backend, used)
  redis.call('HSET', ns .. 'count', backend, count)
  return added
end
-- A request in flight pins its blocks on the backend the store placed it on: a count of the requests
-- holding each block, expiring after ttl_ms, so the pins of a replica that dies go with time. Returns
-- the bytes nobody held there before: the KV room this request takes now.
local function pin(backend, blocks, sizes, ttl_ms)
  local taken = 0
  for i = 1, #blocks do
    local key = ns .. 'pin:' .. backend .. ':' .. blocks[i]
    if redis.call('INCR', key) == 1 then taken = taken + tonumber(sizes[i]) end
    redis.call('PEXPIRE', key, ttl_ms)
  end
  return taken
end
local function unpin(backend, blocks)
  for i = 1, #blocks do
    local key = ns .. 'pin:' .. backend .. ':' .. blocks[i]
    local left = tonumber(redis.call('GET', key) or '0') or 0
    if left > 1 then redis.call('DECR', key) elseif left == 1 then redis.call('DEL', key) end
  end
end
local function capacity_of(backend)
  return tonumber(redis.call('HGET', ns .. 'cap', backend) or '') or 1099511627776
end
-- A hash's fields and values (flat pairs) replace what it held, to expire after ttl_ms; false if empty.
local function replace_hash(key, flat, ttl_ms)
  redis.call('DEL', key)
  if #flat == 0 then return false end
  redis.call('HSET', key, unpack(flat))
  redis.call('PEXPIRE', key, ttl_ms)
  return true
end
-- This replica's requests in flight (pairs of backend and count) replace what it said before.
local function write_load(me, flat, ttl_ms)
  if replace_hash(ns .. 'ld:' .. me, flat, ttl_ms) then redis.call('SADD', ns .. 'replicas', me) end
end
-- Pairs of backend and count as a table, and back (in the order first seen).
local function tally(flat)
  local counts, order = {}, {}
  for k = 1, #flat, 2 do
    if counts[flat[k]] == nil then order[#order + 1] = flat[k] end
    counts[flat[k]] = (counts[flat[k]] or 0) + tonumber(flat[k + 1])
  end
  return counts, order
end
local function add(counts, order, backend, n)
  if counts[backend] == nil then
    order[#order + 1] = backend
    counts[backend] = 0
  end
  counts[backend] = counts[backend] + n
end
local function as_pairs(counts, order)
  local flat = {}
  for _, b in ipairs(order) do
    if counts[b] > 0 then
      flat[#flat + 1] = b
      flat[#flat + 1] = counts[b]
    end
  end
  return flat
end
-- This replica's claims awaiting their answer (`flight`: pairs of claim id and backend proposed),
-- added to its counts where the store counted each when its script ran (`cl:<me>`: claim id ->
-- backend), else where it proposed (its script has not run yet); a claim sent after `upto` whose
-- script ran first (another connection) is counted too. Any other entry's answer came back before
-- these counts were taken: its request is among them already. Returns the entries still to keep.
local function count_flight(me, counts, order, flight, upto)
  local where = {}
  local all = redis.call('HGETALL', ns .. 'cl:' .. me)
  for k = 1, #all, 2 do where[all[k]] = all[k + 1] end
  local kept = {}
  for k = 1, #flight, 2 do
    local id = flight[k]
    add(counts, order, where[id] or flight[k + 1], 1)
    if where[id] then
      kept[#kept + 1] = id
      kept[#kept + 1] = where[id]
      where[id] = nil
    end
  end
  for id, backend in pairs(where) do
    if tonumber(id) > upto then
      add(counts, order, backend, 1)
      kept[#kept + 1] = id
      kept[#kept + 1] = backend
    end
  end
  return kept
end
local function keep_flight(me, kept, ttl_ms)
  replace_hash(ns .. 'cl:' .. me, kept, ttl_ms)
end
-- The other replicas' requests in flight, summed per backend (and the backends in the order first
-- seen). A replica whose counts expired (gone, or idle) leaves the set.
local function peer_loads(me)
  local sums, order = {}, {}
  for _, r in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
    if r ~= me then
      local flat = redis.call('HGETALL', ns .. 'ld:' .. r)
      if #flat == 0 then redis.call('SREM', ns .. 'replicas', r) end
      for k = 1, #flat, 2 do
        local b = flat[k]
        if sums[b] == nil then
          sums[b] = 0
          order[#order + 1] = b
        end
        sums[b] = sums[b] + tonumber(flat[k + 1])
      end
    end
  end
  return sums, order
end
"""

# ARGV: namespace, proposed backend, its capacity (bytes), max entries, follow table, the blocks, their sizes,
# the listed backends, the request's mark ('' none), wait ('1': report a pending prefill), marks' lifetime
# (ms), this replica, its in-flight pairs (with pairs of 'held <backend>' and the bytes its requests in flight
# hold there), their lifetime (ms), the follow limit ('0': none), its other claims awaiting their answer
# (pairs of claim id and backend proposed), this claim's id, the pins' lifetime (ms; '': the request's blocks
# are not pinned on the chosen backend), the lifetime of the receipt of where they were pinned and of a
# give-up (ms, GIVE_UP_SCRIPT), the listed backends a first placement may go to ('0'/'1' each; '': the
# proposed backend stands) and their capacities, the end of the previous turn's prompt whose taker a first
# placement follows ('': none), '1' when an owned prefix that ends where a claimed prompt ended, and that
# nothing went on from since, is followed whatever share it covers (ClaimRequest.continued). The reply is one
# newline-joined string: chosen, depth, followed, the mark to wait for ('-' none), marked, the bytes this
# claim added to the chosen backend's footprint, which listed backends also hold the prefix followed (one '0'
# or '1' each; '-' when none was followed), the backend the request is counted on, which listed backends the
# fleet's counts put at the follow limit (bits again; '-' without a limit), the bytes the request takes there
# (held for it), '1' if it went to the previous turn's taker; bytes used, oldest use and entries of each
# listed backend; then backend and count pairs of the others' in-flight requests, and 'held <backend>' and the
# bytes those hold there. The replica's own counts are written with its request counted on the chosen backend,
# or, when that owner is at the follow limit, on the first holder under it: where the replica will send it
# (routing/shared_view.py, `resolve`), so that the claims other replicas make before this one's next write see
# it there.
CLAIM_SCRIPT = (
    _RECORD
    + f"local FULL_SHARE = {FULL_SHARE!r}\n"
    + """
local proposed = ARGV[2]
local max_entries = tonumber(ARGV[4])
local follow = ARGV[5]
local blocks, sizes, listed = split(ARGV[6]), split(ARGV[7]), split(ARGV[8])
local mark, wait, mark_ttl = ARGV[9], ARGV[10] == '1', ARGV[11]
if mark ~= '' and redis.call('EXISTS', ns .. 'e:' .. mark) == 1 then mark = '' end
local me, load_ttl = ARGV[12], ARGV[14]
local mine, order = tally(split(ARGV[13]))
local claim_id = ARGV[17]
local kept = count_flight(me, mine, order, split(ARGV[16]), tonumber(claim_id))
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
-- `end:<block>`: the last block of a claim that owned it first, '0' until a claim went on past it
-- ('1'). An owned prefix that ends there and that nothing went on from is one prompt's own history, a
-- conversation's next turn: with `continued` it is followed whatever share of the request it covers.
-- A system prompt went on to every conversation after the first; an inner block of a prompt whose
-- tail aged out was never an end: neither is followed by this.
local end_key = depth > 0 and ns .. 'end:' .. blocks[depth]
if depth > 0 and (string.sub(follow, depth, depth) == '1'
    or (ARGV[23] == '1' and redis.call('GET', end_key) == '0')) then
  chosen, followed = owners[depth], 1
end
if depth > 0 and depth < n then redis.call('SET', end_key, '1', 'XX') end
if depth < n then redis.call('SET', ns .. 'end:' .. blocks[n], '0') end
local sums, peer_order = peer_loads(me)
-- A first placement (no prefix followed) is made here when the replica allows it (`room`: one bit
-- per listed backend it may place on now, with their capacities): the listed backend whose cache
-- keeps things longest, by the fleet's footprints and the bytes every replica's requests in flight
-- hold, ranked as one router's cache_room ranks (routing/footprint.py): (0, -room) while there is
-- room, then (1, oldest use), last (2, bytes held) where those holds leave no room for this
-- request. Made after the replica's pick, two replicas placing new prompts in the same instant
-- would both take the one backend with room as each saw it before the other's claim.
local room = ARGV[20] or ''
local caps = room ~= '' and split(ARGV[21]) or {}
-- A turn whose previous prompt filled no block claimed nothing of it: that prompt's end names who took
-- it (`t:<end>`, written when its answer began), and the turn goes there while the replica may place
-- on it, as one router follows its own note of it.
local turn_taken = 0
local previous = ARGV[22] or ''
if followed == 0 and room ~= '' and previous ~= '' then
  local taker = redis.call('GET', ns .. 't:' .. previous)
  for j = 1, m do
    if taker and listed[j] == taker and string.sub(room, j, j) == '1' then
      chosen, turn_taken = taker, 1
      redis.call('HSET', ns .. 'cap', chosen, caps[j])
      break
    end
  end
end
if followed == 0 and room ~= '' and turn_taken == 0 then
  local size = 0
  for i = 1, n do size = size + tonumber(sizes[i]) end
  local best, best_cap, best_a, best_v = nil, nil, nil, nil
  for j = 1, m do
    if string.sub(room, j, j) == '1' then
      local b, cap = listed[j], tonumber(caps[j])
      local held = (mine['held ' .. b] or 0) + (sums['held ' .. b] or 0)
      local used = tonumber(redis.call('HGET', ns .. 'used', b) or '0') or 0
      local entries = redis.call('ZCARD', ns .. 'lru:' .. b)
      local a, v
      if cap - held < size then
        a, v = 2, held
      elseif used < FULL_SHARE * cap and entries < max_entries then
        a, v = 0, used - cap
      else
        local oldest = redis.call('ZRANGE', ns .. 'lru:' .. b, 0, 0, 'WITHSCORES')[2]
        a, v = 1, tonumber(oldest or '-1')  -- as the answer's figures say it: -1 when empty
      end
      if best == nil or a < best_a or (a == best_a and v < best_v) then
        best, best_cap, best_a, best_v = b, cap, a, v
      end
    end
  end
  if best ~= nil then
    chosen = best
    redis.call('HSET', ns .. 'cap', chosen, best_cap)
  end
end
-- Another request prefilling, on the chosen owner, blocks that cover enough of this one: its mark.
local wait_for = '-'
if wait and followed == 1 then
  local mark_keys = {}
  for i = 1, depth do mark_keys[i] = ns .. 'p:' .. blocks[i] end
  local marks = redis.call('MGET', unpack(mark_keys))
  for i = depth, 1, -1 do
    if marks[i] and owners[i] == chosen and string.sub(follow, i, i) == '1' then
      wait_for = marks[i]
      break
    end
  end
end
if wait_for ~= '-' then
  -- This request is held for that prefill, counted on the owner meanwhile; the prefill may end on
  -- another backend (its request moved), and every replica's waiters go there at once: its end
  -- counts them there (PREFILLED_SCRIPT).
  local waiters = ns .. 'w:' .. wait_for
  redis.call('HSETNX', waiters, '=', chosen)
  redis.call('HINCRBY', waiters, me, 1)
  redis.call('PEXPIRE', waiters, mark_ttl)
end
local unowned, marked = {}, 0
for i = 1, n do
  if not owners[i] then
    unowned[#unowned + 1] = owner_keys[i]
    unowned[#unowned + 1] = chosen
    if mark ~= '' then
      redis.call('SET', ns .. 'p:' .. blocks[i], mark, 'PX', mark_ttl)
      marked = 1
    end
  end
end
if #unowned > 0 then redis.call('MSET', unpack(unowned)) end
local pin_ttl = ARGV[18]
-- A claim its replica gave up on (timed out) before it ran pins nothing; one that pins leaves a
-- receipt of where, so that a replica giving up on it after it ran can let go of its pins.
local token = me .. ':' .. claim_id
if pin_ttl ~= '' and redis.call('EXISTS', ns .. 'x:' .. token) == 1 then pin_ttl = '' end
local taken = pin_ttl ~= '' and pin(chosen, blocks, sizes, pin_ttl)
if taken then redis.call('SET', ns .. 'pc:' .. token, chosen, 'PX', ARGV[19]) end
local added = record(chosen, capacity_of(chosen), max_entries, blocks, sizes)
-- The KV room the request takes there: the bytes of its blocks no request in flight held (without
-- pins, the bytes new to the footprint).
taken = taken or added
-- Which listed backends besides the owner hold the prefix followed (their footprints have its deepest
-- block): where the request goes, in the walk's order, when the owner is at its bound.
local holders, held = '-', {}
if followed == 1 and m > 0 then
  local bits = {}
  for j = 1, m do
    held[j] = listed[j] ~= chosen and redis.call('ZSCORE', ns .. 'lru:' .. listed[j], blocks[depth])
    bits[j] = held[j] and '1' or '0'
  end
  holders = table.concat(bits)
end
local function fleet_load(b) return (mine[b] or 0) + (sums[b] or 0) end
local limit = tonumber(ARGV[15]) or 0
local counted_on, full = chosen, '-'
if limit > 0 then
  -- Which listed backends the fleet's counts put at the limit (this replica's claims still in flight
  -- among them, as count_flight placed them): no replica follows an owner there, whatever its own
  -- counts say.
  local bits = {}
  for j = 1, m do bits[j] = fleet_load(listed[j]) + 1 > limit and '1' or '0' end
  full = table.concat(bits)
  if followed == 1 and fleet_load(chosen) + 1 > limit then
    for j = 1, m do
      if held[j] and bits[j] == '0' then
        counted_on = listed[j]
        break
      end
    end
  end
end
add(mine, order, counted_on, 1)
-- What this claim takes there is held there too until the replica's next write says what it holds.
if taken > 0 then add(mine, order, 'held ' .. counted_on, taken) end
write_load(me, as_pairs(mine, order), load_ttl)
kept[#kept + 1] = claim_id
kept[#kept + 1] = counted_on
keep_flight(me, kept, load_ttl)
local reply = {chosen, depth, followed, wait_for, marked, added, holders, counted_on, full, taken, turn_taken}
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
for _, b in ipairs(peer_order) do
  reply[#reply + 1] = b
  reply[#reply + 1] = sums[b]
end
return table.concat(reply, '\\n')
"""
)

# ARGV: namespace, source, target, target's capacity, max entries, after, the blocks, their sizes, the
# pins' lifetime (ms; '': the claim pinned nothing). Blocks past `after` that `source` owns move to
# `target`, out of the source's footprint; the target's footprint gets every block of the request,
# and the pins its claim put on the source move there with it.
TAKEOVER_SCRIPT = (
    _RECORD
    + """
local source, target = ARGV[2], ARGV[3]
local max_entries = tonumber(ARGV[5])
local after = tonumber(ARGV[6])
local blocks, sizes = split(ARGV[7]), split(ARGV[8])
local n = #blocks
redis.call('HSET', ns .. 'cap', target, ARGV[4])
if ARGV[9] ~= '' then
  unpin(source, blocks)
  pin(target, blocks, sizes, ARGV[9])
end
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


# ARGV: namespace, the mark, the request's blocks, the backend it went to, the marks' lifetime (ms).
# The prefill under that mark ended (its first byte, or the attempt's end): its marks go, and every
# replica hears the mark and the backend (which the waiters go to: it may not be the owner their claim
# named) on `prefilled`, with every replica's requests in flight there at this moment (pairs of
# replica and count, each replica's requests held for this prefill among them when it ended
# elsewhere than the owner they are counted on meanwhile, `w:<mark>`): the waiters of every replica go
# at once, and must be admitted on the fleet's counts of now, not on the ones their claims saw before
# the wait. `e:<mark>` says it ended, for a claim under that mark that comes after (one whose answer
# came too late for the replica that sent it): that claim marks nothing.
PREFILLED_SCRIPT = """
local ns, mark, backend = ARGV[1], ARGV[2], ARGV[4]
redis.call('SET', ns .. 'e:' .. mark, '1', 'PX', ARGV[5])
for block in string.gmatch(ARGV[3], '[^\\n]+') do
  local key = ns .. 'p:' .. block
  if redis.call('GET', key) == mark then redis.call('DEL', key) end
end
-- The requests held for this prefill (per replica; `=`: the owner they are counted on while held)
-- go where it ended: where that is not the owner, they count there too.
local waiters = ns .. 'w:' .. mark
local flat = redis.call('HGETALL', waiters)
redis.call('DEL', waiters)
local held, held_on = {}, backend
for k = 1, #flat, 2 do
  if flat[k] == '=' then held_on = flat[k + 1] else held[flat[k]] = tonumber(flat[k + 1]) end
end
local message = {mark, backend}
for _, r in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
  local count = tonumber(redis.call('HGET', ns .. 'ld:' .. r, backend) or '0')
  if held_on ~= backend then count = count + (held[r] or 0) end
  if count > 0 then
    message[#message + 1] = r
    message[#message + 1] = count
  end
end
return redis.call('PUBLISH', ns .. 'prefilled', table.concat(message, '\\n'))
"""

# ARGV: namespace, backend, its capacity, max entries, the blocks, their sizes. A request held for a
# prefill of its prefix on that backend goes there now: the prefix was just used there, as the
# engine sees it, and a block that lost its owner while the prefill ran (moved by a take-over, or aged
# out past its pin's lifetime) is owned by that backend again.
TOUCH_SCRIPT = (
    _RECORD
    + """
local backend = ARGV[2]
local blocks, sizes = split(ARGV[5]), split(ARGV[6])
redis.call('HSET', ns .. 'cap', backend, ARGV[3])
record(backend, tonumber(ARGV[3]), tonumber(ARGV[4]), blocks, sizes)
for i = 1, #blocks do
  redis.call('SET', ns .. 'o:' .. blocks[i], backend, 'NX')
end
return 1
"""
)

# ARGV: namespace, then one argument per request that ended: the backend its claim pinned its blocks
# on, then those blocks (newline-joined). Each lets go of its pins there.
UNPIN_SCRIPT = (
    _RECORD
    + """
for g = 2, #ARGV do
  local items = split(ARGV[g])
  local backend = table.remove(items, 1)
  unpin(backend, items)
end
return 1
"""
)

# ARGV: namespace, this replica, the id of a claim it gave up waiting for, that claim's blocks, the
# lifetime of the give-up (ms). The claim may have run (its receipt says where it pinned the blocks:
# they are let go of) or may yet (it will pin nothing).
GIVE_UP_SCRIPT = (
    _RECORD
    + """
local token = ARGV[2] .. ':' .. ARGV[3]
local receipt = ns .. 'pc:' .. token
local backend = redis.call('GET', receipt)
if backend then
  unpin(backend, split(ARGV[4]))
  redis.call('DEL', receipt)
else
  redis.call('SET', ns .. 'x:' .. token, '1', 'PX', ARGV[5])
end
return 1
"""
)

# ARGV: namespace, a prompt's end, the backend that took it, the note's lifetime (ms).
TAKER_SCRIPT = """
redis.call('SET', ARGV[1] .. 't:' .. ARGV[2], ARGV[3], 'PX', ARGV[4])
return 1
"""

# ARGV: namespace, this replica, its in-flight pairs, their lifetime (ms), its claims awaiting their
# answer (pairs of claim id and backend proposed), the last claim id it issued.
LOAD_SCRIPT = (
    _RECORD
    + """
local me, ttl = ARGV[2], ARGV[4]
local counts, order = tally(split(ARGV[3]))
local kept = count_flight(me, counts, order, split(ARGV[5]), tonumber(ARGV[6]))
write_load(me, as_pairs(counts, order), ttl)
keep_flight(me, kept, ttl)
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


def _count(counts: dict[str, int], backend: str, change: int) -> None:
    """Add `change` to a backend's count, leaving out a backend whose count falls to 0."""
    left = counts.get(backend, 0) + change
    if left > 0:
        counts[backend] = left
    else:
        counts.pop(backend, None)


def _packed(counts: dict[str, int]) -> str:
    return "\n".join(f"{backend}\n{count}" for backend, count in counts.items())


def _lines(values: Iterable[object]) -> str:
    """A list as the scripts take it: one newline-joined argument (see _RECORD's `split`)."""
    return "\n".join(map(str, values))


def _unpin_groups(ended: Sequence[tuple[str, ClaimRequest]]) -> list[str]:
    """UNPIN_SCRIPT's arguments: per request ended, its backend, then its blocks."""
    return [_lines((backend_id, *request.blocks)) for backend_id, request in ended]


def _packed_flight(in_flight: dict[int, str]) -> str:
    return "\n".join(f"{claim_id}\n{backend}" for claim_id, backend in in_flight.items())


class SharedPlacement:
    """The store client: claim (awaited, bounded); take over, end of a prefill, load (background);
    reconnect and the `prefilled` subscription, pinged while quiet (background)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        registry: CollectorRegistry,
        *,
        namespace: str = NAMESPACE,
        max_entries: int = LEDGER_ENTRIES,
        reconnect_interval_s: float = RECONNECT_INTERVAL_S,
        load: LoadTracker | None = None,
        held: Callable[[], dict[str, int]] | None = None,
        prefill_wait_s: float = 0.0,
        load_ttl_s: float = LOAD_TTL_S,
        subscription_ping_s: float = SUBSCRIPTION_PING_S,
        pin_ttl_s: float = PIN_TTL_S,
        receipt_ttl_s: float = CLAIM_RECEIPT_TTL_S,
    ) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._namespace = namespace
        self._max_entries = str(max_entries)
        self._reconnect_interval_s = reconnect_interval_s
        self._subscription_ping_s = subscription_ping_s
        self._load = load
        self._held = held  # the bytes this replica's requests in flight hold, per backend
        # Marks live as long as a request waits for one: past that nobody would still be waiting.
        self._mark_ttl_ms = str(max(1, round(prefill_wait_s * 1000))) if prefill_wait_s > 0 else ""
        self._load_ttl_s = load_ttl_s
        self._load_ttl_ms = str(max(1, round(load_ttl_s * 1000)))
        self._pin_ttl_ms = str(max(1, round(pin_ttl_s * 1000))) if pin_ttl_s > 0 else ""
        self._receipt_ttl_ms = str(max(1, round(receipt_ttl_s * 1000)))
        self._taker_ttl_ms = str(max(1, round(PROMPT_TAKER_TTL_S * 1000)))
        # Requests ended whose pins the store has not let go of yet, and the backend they are on.
        self._unpins: list[tuple[str, ClaimRequest]] = []
        self._batching = False  # the background loop sends them, every LOAD_FLUSH_S
        self.replica = secrets.token_hex(8)  # this process, in marks and in-flight counts
        self._marks = itertools.count(1)
        self._sent_counts: dict[str, int] = {}  # what the store last heard of this replica's counts
        self._sent_at = -1e9  # the loop's time when it did
        self._claim_ids = itertools.count(1)
        self._last_claim_id = 0
        self._in_flight: dict[int, str] = {}  # claims awaiting their answer: id -> backend proposed
        self._sent_flight: frozenset[int] = frozenset()  # the claims in flight the store last heard of
        self._held_back: dict[str, int] = {}  # requests held for another replica's prefill, per backend
        self._flush_now = asyncio.Event()  # the counts a claim wrote are wrong: write them at once
        # Calls made in the background, not awaited by a request: take-overs, ends of prefills, counts.
        self.background_calls = 0
        self.load_writes = 0  # of which: this replica's counts, when no claim carried them
        self._subscribed = False
        self._waiting: dict[str, list[asyncio.Future[str | None]]] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # mark -> the backend that prefilled
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
        self._prefilled = self._redis.register_script(PREFILLED_SCRIPT)
        self._write_load = self._redis.register_script(LOAD_SCRIPT)
        self._touch = self._redis.register_script(TOUCH_SCRIPT)
        self._unpin = self._redis.register_script(UNPIN_SCRIPT)
        self._give_up = self._redis.register_script(GIVE_UP_SCRIPT)
        self._taker = self._redis.register_script(TAKER_SCRIPT)
        self._scripts = (
            self._claim,
            self._takeover,
            self._prefilled,
            self._write_load,
            self._touch,
            self._unpin,
            self._give_up,
            self._taker,
        )
        self._up = False
        self._timeouts = 0
        self._said: bool | None = None  # the state the last log line announced
        self._reply_said = False
        self._pending: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._is_up = asyncio.Event()  # set while up: the subscription starts as soon as the store answers
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

    @property
    def can_wait(self) -> bool:
        """Would the end of another replica's prefill be heard now (the subscription is open)?"""
        return self._subscribed and self._up

    def new_mark(self) -> str:
        """A mark for the prefill one request may open; '' when waits are off."""
        if not self._mark_ttl_ms:
            return ""
        return f"{self.replica}:{next(self._marks)}"

    async def run(self) -> None:
        """The background work: the store's state, the `prefilled` subscription, the counts and the
        pins let go of."""
        self._batching = self._load is not None
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._keep_up())
                if self._mark_ttl_ms:
                    group.create_task(self._listen())
                if self._load is not None:
                    group.create_task(self._flush_load())
        finally:
            self._batching = False

    async def _keep_up(self) -> None:
        """Keep the store's state known: ping until it answers, then wait until a call fails."""
        while True:
            if not self._up:
                # Connections opened before it went down lead to a server that is gone or stuck: each
                # would fail its next call and call the store down again, once per pooled connection.
                with contextlib.suppress(Exception):
                    await self._redis.connection_pool.disconnect()
                if await self._ping():
                    self._mark(True)
                else:
                    self._mark(False)
                    await asyncio.sleep(self._reconnect_interval_s)
                    continue
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        if self._up and self._unpins:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await self._unpin(args=[self._namespace, *_unpin_groups(self._unpins)])
        self._unpins.clear()
        for task in list(self._pending):
            task.cancel()
        for task in list(self._pending):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._wake_all()
        if self._up and self._load is not None:
            # This replica's counts go with it, rather than for LOAD_TTL_S after it.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await self._redis.delete(
                        f"{self._namespace}ld:{self.replica}", f"{self._namespace}cl:{self.replica}"
                    )
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()

    async def claim(self, request: ClaimRequest) -> ClaimAnswer | None:
        """The store's answer, or None (down, slow or wrong: the caller keeps its local decision)."""
        if not self._up:
            return None
        counts = self._counts()
        flight = _packed_flight(self._in_flight)  # the claims in flight before this one
        sent_flight = frozenset(self._in_flight)
        claim_id = self._last_claim_id = next(self._claim_ids)
        self._in_flight[claim_id] = request.proposed
        mark = request.mark if self._mark_ttl_ms else ""
        args: list[str | int] = [
            self._namespace,
            request.proposed,
            int(request.capacity_bytes),
            self._max_entries,
            request.follow,
            _lines(request.blocks),
            _lines(request.sizes),
            _lines(request.listed),
            mark,
            "1" if request.wait and self._subscribed else "0",
            self._mark_ttl_ms or "1",
            self.replica,
            _packed(counts),
            self._load_ttl_ms,
            request.follow_limit,
            flight,
            claim_id,
            self._pin_ttl_ms,
            self._receipt_ttl_ms,
            request.room,
            _lines(int(c) for c in request.capacities),
            request.previous_end or "",
            "1" if request.continued else "0",
        ]
        answer: ClaimAnswer | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await self._claim(args=args)
            answer = parse_answer(reply, request.listed)
        except Exception as exc:  # never fails a request: every failure routes locally
            self._failed(exc)
            return None
        finally:
            del self._in_flight[claim_id]
            if answer is None and mark:
                # Timed out, unreadable or cancelled: the claim may have run, or may yet. Its marks
                # must not hold other replicas' requests for a prefill nobody will say has ended.
                self.prefilled(mark, request, request.proposed)
            if answer is None and self._pin_ttl_ms and request.blocks:
                # Its pins, if it made any, would hold blocks no request of ours holds.
                blocks = _lines(request.blocks)
                self._background(
                    self._give_up, [self._namespace, self.replica, claim_id, blocks, self._receipt_ttl_ms]
                )
        self._timeouts = 0
        counts[answer.counted_on] = counts.get(answer.counted_on, 0) + 1  # as the script wrote them
        if answer.taken:
            held = HELD + answer.counted_on
            counts[held] = counts.get(held, 0) + answer.taken
        self._sent_counts, self._sent_flight = counts, sent_flight
        self._sent_at = asyncio.get_running_loop().time()
        return answer

    def _counts(self) -> dict[str, int]:
        """This replica's requests in flight per backend and the ones held for another replica's
        prefill (where they will go): they take a lease the moment the prefill's end comes, and a
        count written meanwhile must not leave them out. The ones whose claim awaits its answer go
        with every write apart (`_in_flight`): the store counts each where its claim counted it."""
        counts = self._load.local_counts() if self._load is not None else {}
        for backend, n in self._held_back.items():
            counts[backend] = counts.get(backend, 0) + n
        if self._held is not None:
            for backend, n in self._held().items():
                counts[HELD + backend] = n
        return counts

    def waiting_on(self, backend_id: str, change: int) -> None:
        """A request held for another replica's prefill will go to `backend_id` (change 1) or has
        stopped waiting (-1): counted there meanwhile, in the next write of this replica's counts."""
        _count(self._held_back, backend_id, change)

    def counts_moved(self) -> None:
        """The request a claim counted on its chosen backend goes elsewhere: this replica's counts are
        written in the background as soon as the caller yields (its lease is taken by then), rather
        than after LOAD_FLUSH_S, while the others would see the backend it goes to one short."""
        self._flush_now.set()

    def touch(self, request: ClaimRequest, backend_id: str, capacity_bytes: float) -> None:
        """The request, held for a prefill of its prefix on `backend_id`, goes there now: its blocks
        are used now there, and owned by it where nobody owns them (background)."""
        if not self._up:
            return
        args: list[str | int] = [
            self._namespace,
            backend_id,
            int(capacity_bytes),
            self._max_entries,
            _lines(request.blocks),
            _lines(request.sizes),
        ]
        self._background(self._touch, args)

    def unpin(self, backend_id: str, request: ClaimRequest) -> None:
        """The request whose claim pinned its blocks on `backend_id` (where a take-over moved them) has
        ended: the store lets go of them, and hears this replica's counts, as soon as the caller
        yields (background; the ends of one moment go in one batch). The KV room and the slot it
        frees are often taken the next moment, on another replica (a client sends its next request
        as this one ends): after LOAD_FLUSH_S, that replica would place on the fleet as it was."""
        if self._batching:
            self._flush_now.set()
        if not self._pin_ttl_ms or not request.blocks:
            return
        self._unpins.append((backend_id, request))
        if not self._batching:
            self._send_unpins()

    def _send_unpins(self) -> None:
        """One background call for the requests ended since the last; while the store is down they
        are dropped, and their pins expire."""
        if not self._unpins:
            return
        ended, self._unpins = self._unpins, []
        if self._up:
            self._background(self._unpin, [self._namespace, *_unpin_groups(ended)])

    def prompt_taken(self, prompt_end: int, backend_id: str) -> None:
        """A prompt that filled no block (it claimed nothing) is being answered by `backend_id`: noted
        by its end, so that the replica the next turn reaches sends it there (background, at once: the
        next turn may come as soon as this answer ends)."""
        if self._up:
            args: list[str | int] = [self._namespace, prompt_end, backend_id, self._taker_ttl_ms]
            self._background(self._taker, args)

    def prefilled(self, mark: str, request: ClaimRequest, backend_id: str) -> None:
        """The prefill under `mark` on `backend_id` ended: its marks go and the replicas hear it
        (background)."""
        if not mark:
            return
        # Even while the store is called down (it may only be slow): other replicas' requests may be
        # waiting for this, until prefill_wait_s.
        blocks = _lines(request.blocks)
        args: list[str | int] = [self._namespace, mark, blocks, backend_id, self._mark_ttl_ms or "1"]
        self._background(self._prefilled, args)

    async def wait_prefilled(self, mark: str, timeout_s: float) -> tuple[str, str] | None:
        """Wait for the end of another replica's prefill: ('ready', the backend that prefilled) or
        ('timeout', ''); None when its end cannot be heard (no subscription, or it was lost)."""
        ended = self._ended.get(mark)
        if ended is not None:
            return "ready", ended
        if not self._subscribed:
            return None
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(mark, []).append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                backend = await fut
        except TimeoutError:
            return "timeout", ""
        finally:
            waiting = self._waiting.get(mark)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del self._waiting[mark]
        return None if backend is None else ("ready", backend)

    async def _listen(self) -> None:
        """Hold the `prefilled` subscription while the store is up; wake the waiters of each mark."""
        channel = f"{self._namespace}prefilled"
        while True:
            await self._is_up.wait()
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self._subscribed = True
                pinged = False
                while True:
                    message = await pubsub.get_message(timeout=self._subscription_ping_s)
                    if message is not None:
                        pinged = False  # anything heard, a pong too, says the connection lives
                        if message.get("type") == "message":
                            self._heard(message["data"])
                        continue
                    if pinged:
                        raise RedisConnectionError("the prefilled subscription does not answer its ping")
                    await pubsub.ping()
                    pinged = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._count(exc)
            finally:
                self._subscribed = False
                self._wake_all()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis-py 8.2
            await asyncio.sleep(self._reconnect_interval_s)

    def _heard(self, data: object) -> None:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        mark, _, rest = text.partition("\n")
        backend, _, counts = rest.partition("\n")
        if self._load is not None and self._up:
            # The others' requests in flight where this prefill ended, as of its end: what this
            # replica's waiters, all woken now, are admitted on there.
            items = counts.split("\n") if counts else []
            with contextlib.suppress(ValueError):
                others = sum(
                    int(items[i + 1]) for i in range(0, len(items) - 1, 2) if items[i] != self.replica
                )
                self._load.set_peer(backend, others)
        self._ended[mark] = backend
        if len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        for fut in self._waiting.pop(mark, ()):
            if not fut.done():
                fut.set_result(backend)

    def _wake_all(self) -> None:
        """Nobody will say these prefills ended: stop waiting for them."""
        waiting, self._waiting = self._waiting, {}
        for futs in waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    async def _flush_load(self) -> None:
        """Write this replica's counts when they changed and no claim carried them for LOAD_FLUSH_S,
        at once when a claim counted its request where it did not go (`counts_moved`) or a request
        ended (`unpin`), and before they expire while they stay the same; and the pins of the
        requests ended meanwhile."""
        loop = asyncio.get_running_loop()
        flush_now = self._flush_now
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOAD_FLUSH_S):
                    await flush_now.wait()
            moved = flush_now.is_set()
            flush_now.clear()
            self._send_unpins()
            if not self._up:
                continue
            since = loop.time() - self._sent_at
            if since < LOAD_FLUSH_S and not moved:
                continue  # a claim carried them just now
            counts, flight = self._counts(), frozenset(self._in_flight)
            if (
                counts == self._sent_counts
                and flight == self._sent_flight
                and ((not counts and not flight) or since < self._load_ttl_s / 3)
            ):
                continue  # the store has them, and they do not expire yet
            self._sent_counts, self._sent_flight, self._sent_at = counts, flight, loop.time()
            self.load_writes += 1
            self.background_calls += 1
            args: list[str | int] = [
                self._namespace,
                self.replica,
                _packed(counts),
                self._load_ttl_ms,
                _packed_flight(self._in_flight),
                self._last_claim_id,
            ]
            await self._call(self._write_load, args)

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
            _lines(request.blocks),
            _lines(request.sizes),
            self._pin_ttl_ms,
        ]
        self._background(self._takeover, args)

    def _background(self, script: AsyncScript, args: Sequence[str | int]) -> None:
        self.background_calls += 1
        task = asyncio.get_running_loop().create_task(self._call(script, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _call(self, script: AsyncScript, args: Sequence[str | int]) -> None:
        try:
            async with asyncio.timeout(max(self._timeout_s, BACKGROUND_TIMEOUT_S)):
                await script(args=list(args))
        except Exception as exc:
            self._failed(exc)

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(max(self._timeout_s, 0.5)):
                await self._redis.ping()
                # Loaded up front (a restarted server has none): a script's first call is then one
                # round trip, not three, and a background take-over lands before the next request.
                async with self._redis.pipeline(transaction=False) as pipe:
                    for script in self._scripts:
                        pipe.script_load(script.script)
                    await pipe.execute()
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
        if up:
            self._is_up.set()
        else:
            self._is_up.clear()
            self._wake_all()  # the prefills they wait for may never be said to end
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
