"""Workloads for the demo and the routing-quality benchmark, and the oracle hit rate of each.

A workload is an ordered list of OpenAI chat request bodies (plus an optional tenant header), fully
determined by its parameters and a seed, so two runs of a benchmark send byte-identical requests.
Each request carries a `group`: the requests of one group share a prompt prefix, which is what a
routing policy should keep together. Text is pseudo-random words of exact ASCII length, so the
sim's "4 bytes per token" arithmetic gives exact token counts.

The oracle (`oracle_hit_rate`) is the best hit rate any placement could reach, computed with the
sim's own rendering, block hashes and block arithmetic. It is an upper bound under three
simplifications, stated so a benchmark can say what it compared against:
- requests are served in workload order, one after another: a prefix is reusable by every later
  request, even one that in a real run starts before the earlier request's prefill has finished;
- the fleet's caches act as one LRU pool of `capacity_blocks` (per backend x backends): a perfect
  placement would partition prefixes with no duplication and no fragmentation;
- blocks pinned by running requests and decode tokens take no space (the sim caches prompts only).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefix_router.sim.cache import hash_prompt_blocks
from prefix_router.sim.config import SimConfig
from prefix_router.sim.responses import input_messages, rendered_messages
from prefix_router.sim.tokens import BYTES_PER_TOKEN, ChatMessage, render_chat, tokenize_text

DEFAULT_MODEL = "sim-llama"
TENANT_HEADER = "x-prefix-cache-key"
CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    body: dict[str, Any]  # an OpenAI chat body; the load driver adds the streaming fields
    group: str  # requests of one group share a prompt prefix (a system prompt, a document, a chat)
    tenant: str | None = None  # sent as the x-prefix-cache-key header when set
    after: int | None = None  # index of a request that must finish first (the previous chat turn)
    at_s: float | None = None  # a replayed trace's arrival time, seconds from the start of the run
    path: str = CHAT_PATH  # where the body is posted: chat, or the Responses API (`as_responses`)

    def headers(self) -> dict[str, str]:
        return {} if self.tenant is None else {TENANT_HEADER: self.tenant}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    requests: tuple[WorkloadRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)  # how it was generated, for reports

    def __len__(self) -> int:
        return len(self.requests)


def as_responses(workload: Workload, *, tool_calls: bool = False) -> Workload:
    """The same conversations through the Responses API, as a client that keeps no state on the
    server sends them (`store: false`): each turn's messages, answers included, as `input`. The sim
    renders both alike, so the prompts, their blocks and the oracle are the chat workload's.

    With `tool_calls`, as an agent sends its turns: each answer is the model's function call (the
    answer's text its arguments) and each later question that call's output, so no turn after a
    conversation's first carries a new question. The sim renders the call and its output as JSON
    (`prompt_blocks` alike), so the prompts are longer than the chat form's."""

    def agent_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        calls = 0
        for message in messages:
            if message["role"] == "assistant":
                calls += 1
                arguments = json.dumps({"plan": message["content"]})
                items.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{calls}",
                        "call_id": f"call_{calls}",
                        "name": "run",
                        "arguments": arguments,
                        "status": "completed",
                    }
                )
            elif message["role"] == "user" and calls:
                items.append(
                    {"type": "function_call_output", "call_id": f"call_{calls}", "output": message["content"]}
                )
            else:
                items.append(message)
        return items

    def convert(body: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
        items = agent_items(body["messages"]) if tool_calls else body["messages"]
        return out | {"input": items, "max_output_tokens": body["max_tokens"], "store": False}

    requests = tuple(
        dataclasses.replace(r, body=convert(r.body), path=RESPONSES_PATH) for r in workload.requests
    )
    return dataclasses.replace(workload, requests=requests)


# -- text ----------------------------------------------------------------------------------------

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "da", "gu", "sha", "tor", "lin", "mar",
    "ber", "qui", "zan", "fel", "dor", "ix", "um", "on", "ae", "ly", "pre", "sto", "cra", "vin", "hul",
)  # fmt: skip


@functools.cache
def vocabulary(size: int = 1500) -> tuple[str, ...]:
    """The one vocabulary of every workload's text: `size` pseudo-words of 1-4 syllables."""
    rng = random.Random(0x70726566)
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return tuple(sorted(words))


class TextSource:
    """Pseudo-random words of an exact token length (ASCII: one byte per char, 4 chars per token)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._words = vocabulary()

    @property
    def rng(self) -> random.Random:
        return self._rng

    def text(self, tokens: int, lead: str = "") -> str:
        """`tokens * 4` characters: `lead`, then words; starts with `lead` so callers can tag it."""
        chars = max(tokens * BYTES_PER_TOKEN, len(lead))
        parts = [lead] if lead else []
        length = len(lead)
        while length < chars:
            word = self._rng.choice(self._words)
            parts.append(word)
            length += len(word) + (1 if len(parts) > 1 else 0)
        return " ".join(parts)[:chars]


def _chat_body(messages: list[dict[str, str]], max_tokens: int, model: str) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens}


# -- (a) shared-prefix groups -----------------------------------------------------------------------


def shared_prefix(
    *,
    groups: int = 8,
    prompts_per_group: int = 16,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    max_tokens: int = 16,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """SGLang's generated-shared-prefix benchmark in miniature: G groups x P prompts, a long system
    prompt per group and a distinct question per prompt, all shuffled together."""
    src = TextSource(seed)
    requests: list[WorkloadRequest] = []
    for g in range(groups):
        system = src.text(system_tokens, lead=f"System {g}.")
        for p in range(prompts_per_group):
            question = src.text(question_tokens, lead=f"Question {g}.{p}:")
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            requests.append(WorkloadRequest(_chat_body(messages, max_tokens, model), f"g{g}"))
    src.rng.shuffle(requests)
    return Workload(
        "shared_prefix",
        f"{groups} groups x {prompts_per_group} prompts, {system_tokens}-token system prompt per group, "
        f"{question_tokens}-token questions, shuffled",
        tuple(requests),
        {"groups": groups, "prompts_per_group": prompts_per_group, "system_tokens": system_tokens,
         "question_tokens": question_tokens, "seed": seed},
    )  # fmt: skip


# -- (b) long-context shared prefix -----------------------------------------------------------------


def long_context(
    *,
    documents: int = 8,
    questions_per_document: int = 8,
    document_tokens: int = 8000,
    question_tokens: int = 64,
    max_tokens: int = 16,
    seed: int = 1,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Long documents asked many questions (the 8,000-token prefixes of SageMaker's prefix-aware
    routing benchmark): the prefix dwarfs the question, so a miss costs a whole document's prefill."""
    src = TextSource(seed)
    requests: list[WorkloadRequest] = []
    for d in range(documents):
        document = src.text(document_tokens, lead=f"Document {d}.")
        for q in range(questions_per_document):
            question = src.text(question_tokens, lead=f"About document {d}, question {q}:")
            messages = [
                {"role": "system", "content": "Answer from the document below.\n" + document},
                {"role": "user", "content": question},
            ]
            requests.append(WorkloadRequest(_chat_body(messages, max_tokens, model), f"d{d}"))
    src.rng.shuffle(requests)
    return Workload(
        "long_context",
        f"{documents} documents of {document_tokens} tokens x {questions_per_document} questions, shuffled",
        tuple(requests),
        {"documents": documents, "questions_per_document": questions_per_document,
         "document_tokens": document_tokens, "question_tokens": question_tokens, "seed": seed},
    )  # fmt: skip


# -- (c) multi-turn conversations ---------------------------------------------------------------------


def _sharegpt_length(rng: random.Random, median: int, low: int, high: int) -> int:
    """A long-tailed length (lognormal around `median`), as ShareGPT turn lengths are."""
    return max(low, min(high, round(rng.lognormvariate(0.0, 0.9) * median)))


def multi_turn(
    *,
    conversations: int = 24,
    min_turns: int = 2,
    max_turns: int = 8,
    system_tokens: int = 64,
    user_median_tokens: int = 120,
    reply_median_tokens: int = 200,
    max_turn_tokens: int = 1500,
    max_tokens: int = 16,
    seed: int = 2,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Chats whose history grows every turn: turn k+1 = turn k's messages + the assistant's reply +
    a new user message. Lengths are long-tailed, so some whole conversations stay under the router's
    4096-character key (the ring key changes every turn) and others outgrow it in a turn or two.

    Each conversation has its own short system prompt: only the conversation's own history is
    shared. Turns of different conversations are interleaved at random, keeping each chat's order;
    `after` names the previous turn, which must finish before the next is sent."""
    src = TextSource(seed)
    shape = _ChatShape(min_turns, max_turns, user_median_tokens, reply_median_tokens, max_turn_tokens)
    chats = [
        _chat_turns(src, src.text(system_tokens, lead=f"Chat {c}. You are helpful."), f"c{c}", shape)
        for c in range(conversations)
    ]
    return Workload(
        "multi_turn",
        f"{conversations} conversations of {min_turns}-{max_turns} turns, ShareGPT-like lengths, interleaved",
        _interleave(src.rng, chats, max_tokens, model),
        {"conversations": conversations, "min_turns": min_turns, "max_turns": max_turns,
         "system_tokens": system_tokens, "user_median_tokens": user_median_tokens,
         "reply_median_tokens": reply_median_tokens, "max_turn_tokens": max_turn_tokens, "seed": seed},
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class _ChatShape:
    min_turns: int
    max_turns: int
    user_median_tokens: int
    reply_median_tokens: int
    max_turn_tokens: int


def _chat_turns(
    src: TextSource, system: str, group: str, shape: _ChatShape
) -> list[tuple[list[dict[str, str]], str]]:
    """One conversation's turns (its messages before each request) after `system`."""
    rng = src.rng
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    turns: list[tuple[list[dict[str, str]], str]] = []
    for t in range(rng.randint(shape.min_turns, shape.max_turns)):
        length = _sharegpt_length(rng, shape.user_median_tokens, 4, shape.max_turn_tokens)
        user = src.text(length, lead=f"Turn {t}:")
        history = [*history, {"role": "user", "content": user}]
        turns.append((history, group))
        reply = src.text(_sharegpt_length(rng, shape.reply_median_tokens, 8, shape.max_turn_tokens))
        history = [*history, {"role": "assistant", "content": reply}]
    return turns


def _interleave(
    rng: random.Random, chats: list[list[tuple[list[dict[str, str]], str]]], max_tokens: int, model: str
) -> tuple[WorkloadRequest, ...]:
    """Repeatedly take the next turn of a random conversation with turns left; each turn names its
    predecessor in `after`."""
    cursors = [0] * len(chats)
    live = [c for c in range(len(chats)) if chats[c]]
    last_index: dict[int, int] = {}
    requests: list[WorkloadRequest] = []
    while live:
        c = rng.choice(live)
        messages, group = chats[c][cursors[c]]
        body = _chat_body(messages, max_tokens, model)
        requests.append(WorkloadRequest(body, group, None, last_index.get(c)))
        last_index[c] = len(requests) - 1
        cursors[c] += 1
        if cursors[c] == len(chats[c]):
            live.remove(c)
    return tuple(requests)


# -- (d) hot prefix ------------------------------------------------------------------------------------


def hot_prefix(
    *,
    requests: int = 256,
    hot_share: float = 0.5,
    cold_groups: int = 24,
    system_tokens: int = 1024,
    question_tokens: int = 128,
    max_tokens: int = 16,
    seed: int = 3,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """One system prompt in ~`hot_share` of the requests, the rest over `cold_groups` others: a
    pure affinity policy would send half the traffic to one backend."""
    src = TextSource(seed)
    rng = src.rng
    hot = src.text(system_tokens, lead="Hot system prompt.")
    cold = [src.text(system_tokens, lead=f"Cold system prompt {g}.") for g in range(cold_groups)]
    out: list[WorkloadRequest] = []
    for i in range(requests):
        if rng.random() < hot_share:
            system, group = hot, "hot"
        else:
            g = rng.randrange(cold_groups)
            system, group = cold[g], f"cold{g}"
        question = src.text(question_tokens, lead=f"Question {i}:")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out.append(WorkloadRequest(_chat_body(messages, max_tokens, model), group))
    return Workload(
        "hot_prefix",
        f"{requests} requests, {hot_share:.0%} share one system prompt, the rest over {cold_groups} others",
        tuple(out),
        {"requests": requests, "hot_share": hot_share, "cold_groups": cold_groups,
         "system_tokens": system_tokens, "question_tokens": question_tokens, "seed": seed},
    )  # fmt: skip


# -- (e) many tenants, identical prompts -----------------------------------------------------------------


def tenants(
    *,
    tenant_count: int = 32,
    requests_per_tenant: int = 12,
    shared_prompts: int = 2,
    system_tokens: int = 1024,
    question_tokens: int = 64,
    max_tokens: int = 16,
    seed: int = 4,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Many tenants sending the very same prompt set (`shared_prompts` system prompts, the same
    questions), told apart only by `x-prefix-cache-key`. Each tenant also sets vLLM's `cache_salt` to
    its own name, so the engine isolates its cache as the router isolates its placement; the oracle
    counts a hit only within a tenant. The router keys on (tenant, model, prefix), so each (tenant,
    system prompt) pair is one group: a good policy keeps every pair on one backend (sticky) and
    spreads the pairs over the fleet."""
    src = TextSource(seed)
    rng = src.rng
    systems = [src.text(system_tokens, lead=f"Shared assistant {p}.") for p in range(shared_prompts)]
    questions = [src.text(question_tokens, lead=f"Shared question {q}:") for q in range(requests_per_tenant)]
    out: list[WorkloadRequest] = []
    for t in range(tenant_count):
        name = f"tenant-{t:03d}"
        for q in range(requests_per_tenant):
            p = q % shared_prompts
            messages = [
                {"role": "system", "content": systems[p]},
                {"role": "user", "content": questions[q]},
            ]
            body = _chat_body(messages, max_tokens, model) | {"cache_salt": name}
            out.append(WorkloadRequest(body, f"{name}/p{p}", name))
    rng.shuffle(out)
    return Workload(
        "tenants",
        f"{tenant_count} tenants x {requests_per_tenant} requests over the same {shared_prompts} "
        f"{system_tokens}-token system prompts, distinct tenant keys and cache_salt",
        tuple(out),
        {"tenant_count": tenant_count, "requests_per_tenant": requests_per_tenant,
         "shared_prompts": shared_prompts, "system_tokens": system_tokens,
         "question_tokens": question_tokens, "seed": seed},
    )  # fmt: skip


# -- (f) families: chats that share a few system prompts ------------------------------------------------


def families(
    *,
    conversations: int = 24,
    family_count: int = 3,
    system_tokens: int = 1500,
    min_turns: int = 2,
    max_turns: int = 6,
    user_median_tokens: int = 120,
    reply_median_tokens: int = 200,
    max_turn_tokens: int = 1500,
    max_tokens: int = 16,
    seed: int = 5,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Multi-turn chats in a few families (an assistant product each): every chat of a family starts
    with the family's one long system prompt, then its own history. Chat c belongs to family
    c mod `family_count`. A placement that keeps each family on one backend shares the system
    prompt; one that scatters a family pays for it once per backend, and a backend given more
    families than its cache holds evicts them. Interleaved as in `multi_turn`."""
    src = TextSource(seed)
    systems = [src.text(system_tokens, lead=f"Family {f} assistant.") for f in range(family_count)]
    shape = _ChatShape(min_turns, max_turns, user_median_tokens, reply_median_tokens, max_turn_tokens)
    chats = [
        _chat_turns(src, systems[c % family_count], f"f{c % family_count}/c{c}", shape)
        for c in range(conversations)
    ]
    return Workload(
        "families",
        f"{conversations} chats of {min_turns}-{max_turns} turns in {family_count} families, one "
        f"{system_tokens}-token system prompt per family, interleaved",
        _interleave(src.rng, chats, max_tokens, model),
        {"conversations": conversations, "family_count": family_count, "system_tokens": system_tokens,
         "min_turns": min_turns, "max_turns": max_turns, "user_median_tokens": user_median_tokens,
         "reply_median_tokens": reply_median_tokens, "max_turn_tokens": max_turn_tokens, "seed": seed},
    )  # fmt: skip


# -- (g) one system prompt shared by all traffic (the Mooncake shape) --------------------------------------


def shared_system(
    *,
    conversations: int = 32,
    system_tokens: int = 512,
    min_turns: int = 2,
    max_turns: int = 6,
    user_median_tokens: int = 120,
    reply_median_tokens: int = 200,
    max_turn_tokens: int = 1500,
    max_tokens: int = 16,
    seed: int = 6,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Distinct multi-turn conversations behind one system prompt that every request starts with,
    as in the Mooncake conversation trace (every request's first 512-token block is the same). The
    shared part is short and common to the whole fleet's traffic: it must not decide where new
    conversations go. Interleaved as in `multi_turn`."""
    src = TextSource(seed)
    system = src.text(system_tokens, lead="Shared platform system prompt.")
    shape = _ChatShape(min_turns, max_turns, user_median_tokens, reply_median_tokens, max_turn_tokens)
    chats = [_chat_turns(src, system, f"c{c}", shape) for c in range(conversations)]
    return Workload(
        "shared_system",
        f"{conversations} conversations of {min_turns}-{max_turns} turns behind one {system_tokens}-token "
        "system prompt shared by every request, interleaved",
        _interleave(src.rng, chats, max_tokens, model),
        {"conversations": conversations, "system_tokens": system_tokens, "min_turns": min_turns,
         "max_turns": max_turns, "user_median_tokens": user_median_tokens,
         "reply_median_tokens": reply_median_tokens, "max_turn_tokens": max_turn_tokens, "seed": seed},
    )  # fmt: skip


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared_prefix": shared_prefix,
    "long_context": long_context,
    "multi_turn": multi_turn,
    "hot_prefix": hot_prefix,
    "tenants": tenants,
    "families": families,
    "shared_system": shared_system,
}


# -- a fleet on which placement matters ------------------------------------------------------------------

# llm-d-inference-sim's example per-token prefill cost: slow enough that a cold 2k-token prefix costs
# ~0.5 s against ~60 ms warm, so the cache shows in TTFT.
PLACEMENT_PREFILL_MS_PER_TOKEN = 0.25


def cache_sensitive_config(
    *,
    prefix_tokens: int,
    prompt_tokens: int,
    prefixes_per_backend: float,
    running_per_backend: int,
    max_num_seqs: int = 256,
    base: SimConfig | None = None,
) -> SimConfig:
    """A sim config whose KV cache holds `prefixes_per_backend` shared prefixes, the private
    suffixes of `running_per_backend` requests, and one cold prefix being prefilled: a policy that
    keeps groups together fits; one that sends every group everywhere evicts, and its cold prompts
    (each holding all its blocks until its prefill ends) wait for room, as they would on vLLM."""
    cfg = base or SimConfig(prefill_ms_per_token=PLACEMENT_PREFILL_MS_PER_TOKEN, max_num_seqs=max_num_seqs)
    block = cfg.block_size
    prefix_blocks = math.ceil(prefix_tokens / block) + 1
    suffix_blocks = math.ceil(max(prompt_tokens - prefix_tokens, 1) / block) + 1
    capacity = (math.ceil(prefixes_per_backend) + 1) * prefix_blocks
    capacity += max(1, running_per_backend) * suffix_blocks
    return dataclasses.replace(cfg, capacity_blocks=capacity)


# -- the oracle -------------------------------------------------------------------------------------------


def prompt_blocks(body: dict[str, Any], block_size: int) -> tuple[int, list[int]]:
    """(prompt tokens, chained block hashes) of a chat or Responses body, exactly as the sim renders
    and hashes it."""
    if "messages" in body:
        messages = [ChatMessage(str(m["role"]), str(m.get("content") or "")) for m in body["messages"]]
    else:
        messages = rendered_messages(body.get("instructions"), input_messages(body["input"]))
    prompt = tokenize_text(render_chat(messages))
    salt = body.get("cache_salt")
    return prompt.num_tokens, hash_prompt_blocks(prompt, block_size, salt if isinstance(salt, str) else None)


@dataclass(frozen=True, slots=True)
class OracleResult:
    hit_tokens: int
    prompt_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle_from_blocks(
    prompts: Sequence[tuple[int, Sequence[int]]], *, block_size: int, capacity_blocks: int | None
) -> OracleResult:
    """The oracle over (num_tokens, block hashes) in arrival order; see the module docstring.

    A request hits its longest run of leading blocks some earlier request left in the pool, capped as
    the sim caps it at floor((n - 1) / B) blocks (the last prompt token is always recomputed). Then
    its blocks enter the pool tail first, so its prefix is the most recently used part, and the least
    recently used blocks beyond `capacity_blocks` (None: unbounded) are evicted.
    """
    pool: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for num_tokens, hashes in prompts:
        total += num_tokens
        limit = min(len(hashes), max(num_tokens - 1, 0) // block_size)
        matched = 0
        while matched < limit and hashes[matched] in pool:
            matched += 1
        hits += matched * block_size
        for block in reversed(hashes):
            pool[block] = None
            pool.move_to_end(block)
        if capacity_blocks is not None:
            while len(pool) > capacity_blocks:
                pool.popitem(last=False)
    return OracleResult(hits, total)


def oracle_hit_rate(workload: Workload, *, block_size: int, capacity_blocks: int | None) -> OracleResult:
    """Best achievable hit tokens / prompt tokens of `workload` on a fleet caching `capacity_blocks`
    blocks in all (per-backend capacity x backends; None for unbounded)."""
    prompts = [prompt_blocks(r.body, block_size) for r in workload.requests]
    return oracle_from_blocks(prompts, block_size=block_size, capacity_blocks=capacity_blocks)


def distinct_blocks(workload: Workload, *, block_size: int) -> int:
    """The workload's working set: distinct KV blocks over all its prompts (what a cache would need to
    hold every one of them at once), by the sim's own hashing."""
    seen: set[int] = set()
    for r in workload.requests:
        seen.update(prompt_blocks(r.body, block_size)[1])
    return len(seen)


def _prompt_block_counts(workload: Workload, block_size: int) -> list[int]:
    return [-(-prompt_blocks(r.body, block_size)[0] // block_size) for r in workload.requests]


def largest_prompt_blocks(workload: Workload, *, block_size: int) -> int:
    """Blocks of the workload's longest prompt (a backend's cache must hold at least that)."""
    return max(_prompt_block_counts(workload, block_size), default=0)


def median_prompt_blocks(workload: Workload, *, block_size: int) -> int:
    """Blocks of the workload's median prompt (the upper median: a whole number of blocks)."""
    counts = sorted(_prompt_block_counts(workload, block_size))
    return counts[len(counts) // 2] if counts else 0
