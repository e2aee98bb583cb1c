"""The routing key: what decides where a request goes, and that no body can make it raise."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefix_router.routing.config import KeyConfig, KeyMode, RingKey
from prefix_router.routing.hashing import hash_parts
from prefix_router.routing.keys import (
    KeySource,
    RoutingKey,
    block_ends,
    conversation_end,
    extract_key,
    openai_text,
)

CHAT = "/v1/chat/completions"
DEFAULT = KeyConfig()
ROLE_MARK = {role: f"\x1e{role}\x1f" for role in ("system", "user", "assistant")}
SYSTEM = "You are a helpful assistant. " * 20  # 580 chars: spans a few blocks


def key(path: str, body: Any, tenant: str | None = None, config: KeyConfig = DEFAULT) -> RoutingKey:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return extract_key(path, raw, tenant, config)


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def image(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


# -- OpenAI chat ---------------------------------------------------------------------------------

CONVERSATION = chat(("system", SYSTEM), ("user", "What is a KV cache?"))


@settings(max_examples=50)
@given(
    st.fixed_dictionaries(
        {
            "indent": st.sampled_from([None, 2]),
            "sort_keys": st.booleans(),
            "ensure_ascii": st.booleans(),
            "separators": st.sampled_from([None, (",", ":")]),
        }
    ),
    st.lists(
        st.tuples(
            st.sampled_from(
                ["temperature", "top_p", "max_tokens", "seed", "n", "stream", "stop", "logprobs"]
            ),
            st.none() | st.booleans() | st.integers(0, 10**6) | st.floats(0, 2) | st.text(max_size=5),
        ),
        max_size=4,
    ).map(dict),
)
def test_chat_same_messages_same_key(how: dict[str, Any], sampling: dict[str, Any]) -> None:
    doc = {**sampling, **CONVERSATION}
    assert key(CHAT, json.dumps(doc, **how).encode()) == key(CHAT, CONVERSATION)


def test_chat_key_ignores_field_order_around_messages() -> None:
    a = b'{"messages":[{"content":"hi","role":"user"}],"model":"m","temperature":1}'
    b = b'{"temperature":0,"model":"m","messages":[{"role":"user","content":"hi"}]}'
    assert key(CHAT, a) == key(CHAT, b)
    assert key(CHAT, a).source is KeySource.OPENAI


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(chat(("system", "A"), ("user", "q")), chat(("system", "B"), ("user", "q")), id="system"),
        pytest.param(chat(("user", "q1")), chat(("user", "q2")), id="user"),
        pytest.param(chat(("user", "q")), chat(("assistant", "q")), id="role"),
        pytest.param(chat(("user", "ab"), ("user", "c")), chat(("user", "a"), ("user", "bc")), id="boundary"),
        pytest.param(
            chat(("user", "q")), chat(("user", "q"), tools=[{"type": "function"}]), id="tools-added"
        ),
        pytest.param(
            chat(("user", [{"type": "text", "text": "A"}])),
            chat(("user", [{"type": "text", "text": "B"}])),
            id="text-parts",
        ),
        pytest.param(
            chat(("user", [{"type": "text", "text": "look"}, image("AAAA")])),
            chat(("user", [{"type": "text", "text": "look"}, image("BBBB")])),
            id="images",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "user", "content": "q", "name": "alice"}]},
            {"model": "m", "messages": [{"role": "user", "content": "q", "name": "bob"}]},
            id="name",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
            {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "2"}]}]},
            id="tool-calls",
        ),
        pytest.param(
            {"model": "m", "messages": [{"role": "tool", "content": "r", "tool_call_id": "a"}]},
            {"model": "m", "messages": [{"role": "tool", "content": "r", "tool_call_id": "b"}]},
            id="tool-call-id",
        ),
        pytest.param(chat(("user", "q")), {**chat(("user", "q")), "model": "other"}, id="model"),
    ],
)
def test_chat_different_prompts_different_keys(a: dict[str, Any], b: dict[str, Any]) -> None:
    ka, kb = key(CHAT, a), key(CHAT, b)
    assert ka.source is kb.source is KeySource.OPENAI
    assert ka.ring_hash != kb.ring_hash


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param(
            chat(("user", [{"type": "text", "text": "look"}, image("AAAA")])),
            chat(("user", [{"type": "text", "text": "look"}, image("AAAA")])),
            id="same-image",
        ),
        pytest.param(
            chat(("user", "hello")), chat(("user", [{"type": "text", "text": "hello"}])), id="str-vs-part"
        ),
        pytest.param(
            chat(("user", [{"text": "a", "type": "text"}, {"type": "text", "text": "b"}])),
            chat(("user", "ab")),
            id="parts-concatenate",
        ),
        pytest.param(
            chat(("user", [image("AAAA")])),
            chat(("user", [{"image_url": {"url": "data:image/png;base64,AAAA"}, "type": "image_url"}])),
            id="image-key-order",
        ),
        pytest.param(chat(("user", None)), {"model": "m", "messages": [{"role": "user"}]}, id="null-content"),
    ],
)
def test_chat_same_prompt_same_key(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key(CHAT, a).ring_hash == key(CHAT, b).ring_hash


@pytest.mark.parametrize(
    ("message", "rendered"),
    [
        pytest.param({"role": "user", "content": "hi"}, "\x1euser\x1fhi", id="known-role"),
        pytest.param({"content": "hi", "role": "user"}, "\x1euser\x1fhi", id="field-order"),
        pytest.param({"role": "ipython", "content": "hi"}, "\x1eipython\x1fhi", id="other-role"),
        pytest.param({"role": ["user"], "content": "hi"}, "\x1e\x1fhi", id="role-unhashable"),
        pytest.param({"role": 5, "content": "hi"}, "\x1e\x1fhi", id="role-a-number"),
        pytest.param({"content": "hi", "x": 1}, "\x1e\x1fhi", id="no-role"),
        pytest.param({"role": "user", "content": None}, "\x1euser\x1f", id="content-null"),
        pytest.param(
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}, "\x1euser\x1fhi", id="text-parts"
        ),
        pytest.param({"role": "user", "name": "ann", "content": "hi"}, "\x1euser\x1fann\x1fhi", id="name"),
        pytest.param(
            {"role": "tool", "content": "42", "tool_call_id": "c1"}, "\x1etool\x1f42\x1fc1", id="tool-result"
        ),
        pytest.param("just a string", '\x1e"just a string"', id="not-an-object"),
    ],
)
def test_message_rendering(message: Any, rendered: str) -> None:
    # A role marker, then the content; the common shape takes a shortcut that must render the same.
    assert openai_text(CHAT, {"messages": [message]}) == rendered


def test_tools_come_before_messages() -> None:
    doc = {"messages": [{"role": "user", "content": "MSG"}], "tools": [{"name": "TOOL"}]}
    text = openai_text(CHAT, doc)
    assert 0 <= text.index("TOOL") < text.index("MSG")
    # So with a prefix as long as the tools, the messages do not count yet.
    tools_only = openai_text(CHAT, {"tools": doc["tools"]})
    config = KeyConfig(prefix_chars=len(tools_only))
    other = {**doc, "messages": [{"role": "user", "content": "OTHER"}]}
    assert key(CHAT, doc, config=config).ring_hash == key(CHAT, other, config=config).ring_hash
    assert key(CHAT, doc).ring_hash != key(CHAT, other).ring_hash


@settings(max_examples=50)
@given(st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_two_models_never_share_a_key(m1: str, m2: str) -> None:
    if m1 == m2:
        return
    a = key(CHAT, {**CONVERSATION, "model": m1})
    b = key(CHAT, {**CONVERSATION, "model": m2})
    assert a.ring_hash != b.ring_hash
    assert a.blocks[0] != b.blocks[0]
    assert (a.model, b.model) == (m1, m2)


def test_model_not_a_string_is_ignored() -> None:
    assert key(CHAT, {**CONVERSATION, "model": 7}).model is None
    assert key(CHAT, {**CONVERSATION, "model": 7}) == key(
        CHAT, {k: v for k, v in CONVERSATION.items() if k != "model"}
    )


# -- tenants -------------------------------------------------------------------------------------


def test_tenant_argument_changes_key() -> None:
    a, b, none = key(CHAT, CONVERSATION, "a"), key(CHAT, CONVERSATION, "b"), key(CHAT, CONVERSATION)
    assert len({a.ring_hash, b.ring_hash, none.ring_hash}) == 3
    assert a.blocks[0] != b.blocks[0]
    assert key(CHAT, CONVERSATION, "a") == a
    assert a.tenant == "a"


def test_tenant_from_body_field() -> None:
    body = {**CONVERSATION, "prompt_cache_key": "t1"}
    k = key(CHAT, body)
    assert k.tenant == "t1"
    assert k.ring_hash == key(CHAT, CONVERSATION, "t1").ring_hash
    assert k.ring_hash != key(CHAT, {**CONVERSATION, "prompt_cache_key": "t2"}).ring_hash


def test_header_tenant_wins_over_body() -> None:
    k = key(CHAT, {**CONVERSATION, "prompt_cache_key": "body"}, "header")
    assert k.tenant == "header"
    assert k == key(CHAT, CONVERSATION, "header")


def test_body_tenant_ignored_when_not_trusted() -> None:
    config = KeyConfig(tenant_body_field=None)
    k = key(CHAT, {**CONVERSATION, "prompt_cache_key": "t1"}, config=config)
    assert k.tenant is None
    assert k == key(CHAT, CONVERSATION, config=config)


def test_custom_tenant_body_field_and_non_string_value() -> None:
    config = KeyConfig(tenant_body_field="user")
    assert key(CHAT, {**CONVERSATION, "user": "u"}, config=config).tenant == "u"
    assert key(CHAT, {**CONVERSATION, "user": 5}, config=config).tenant is None


# -- prefix truncation and blocks ----------------------------------------------------------------


@pytest.mark.parametrize("prefix_chars", [pytest.param(n, id=str(n)) for n in (1, 10, 64, 1000)])
def test_prefix_chars_truncation(prefix_chars: int) -> None:
    config = KeyConfig(prefix_chars=prefix_chars)
    shared = "é" * prefix_chars  # characters, not bytes
    a = key(CHAT, chat(("user", shared + "tail one")), config=config)
    b = key(CHAT, chat(("user", shared + "another tail")), config=config)
    assert a.ring_hash == b.ring_hash
    c = key(CHAT, chat(("user", "x" + shared)), config=config)
    # The role marker takes a few characters, so 1 char of prefix cannot tell these apart.
    if prefix_chars > 10:
        assert c.ring_hash != a.ring_hash


def _utf8(value: str | None) -> bytes:
    return b"" if value is None else value.encode("utf-8", "surrogatepass")


@settings(max_examples=200)
@given(
    tenant=st.none() | st.text(max_size=300),  # past 128 characters the encoded seed is not cached
    model=st.none() | st.text(max_size=300),
    content=st.text(max_size=300),  # ASCII or not: the first characters are cut two ways
    prefix_chars=st.integers(1, 120),
)
def test_ring_hash_is_tenant_model_and_first_prefix_chars(
    tenant: str | None, model: str | None, content: str, prefix_chars: int
) -> None:
    body = chat(("user", content)) | {"model": model}
    k = key(CHAT, body, tenant, KeyConfig(prefix_chars=prefix_chars, ring_key=RingKey.PREFIX))
    material = openai_text(CHAT, body)[:prefix_chars].encode("utf-8", "surrogatepass")
    assert k.ring_hash == hash_parts(_utf8(tenant), _utf8(model), material)
    assert (k.tenant, k.model) == (tenant, model)


@settings(max_examples=200)
@given(
    tenant=st.none() | st.text(max_size=50),
    system=st.text(max_size=3000),
    turns=st.lists(st.text(max_size=300), min_size=1, max_size=4),
    prefix_chars=st.integers(1, 5000),
)
def test_conversation_ring_hash_is_tenant_model_and_the_text_up_to_its_end(
    tenant: str | None, system: str, turns: list[str], prefix_chars: int
) -> None:
    roles = ("user", "assistant")
    body = chat(("system", system), *((roles[i % 2], t) for i, t in enumerate(turns)))
    k = key(CHAT, body, tenant, KeyConfig(prefix_chars=prefix_chars))
    text = openai_text(CHAT, body)
    end = conversation_end(text, prefix_chars, 0.5)
    assert 0 < end <= prefix_chars
    material = text[:end].encode("utf-8", "surrogatepass")
    assert k.ring_hash == hash_parts(_utf8(tenant), _utf8("m"), material)
    # Every later turn of the same conversation has the first turn's ring position.
    first = key(
        CHAT, chat(("system", system), ("user", turns[0])), tenant, KeyConfig(prefix_chars=prefix_chars)
    )
    assert first.ring_hash == k.ring_hash


SHORT_SYSTEM = "You are a helpful assistant."
LONG_SYSTEM = "You review contracts. " * 100  # 2,200 characters


@pytest.mark.parametrize(
    ("system", "question", "ends_at"),
    [
        pytest.param(LONG_SYSTEM, "q" * 200, "preamble", id="long-system-short-question"),
        pytest.param(LONG_SYSTEM, "q" * 3000, "first-message", id="long-system-longer-question"),
        pytest.param(SHORT_SYSTEM, "q" * 200, "first-message", id="short-system-is-shared-too-widely"),
        pytest.param(None, "q" * 200, "first-message", id="no-system"),
        pytest.param("s" * 5000, "q", "limit", id="preamble-past-prefix-chars"),
    ],
)
def test_where_a_conversations_ring_key_ends(system: str | None, question: str, ends_at: str) -> None:
    messages = ([("system", system)] if system is not None else []) + [("user", question)]
    body = chat(*messages, ("assistant", "an answer"), ("user", "a follow-up"))
    text = openai_text(CHAT, body)
    end = conversation_end(text, 4096, 0.5)
    preamble = 0 if system is None else len(ROLE_MARK["system"]) + len(system)
    expected = {
        "preamble": preamble,
        "first-message": min(4096, preamble + len(ROLE_MARK["user"]) + len(question)),
        "limit": 4096,
    }[ends_at]
    assert end == expected


@pytest.mark.parametrize(
    ("system", "question", "ends_at"),
    [
        pytest.param(LONG_SYSTEM, "q" * 200, "first-message", id="long-system-short-question"),
        pytest.param(None, "q" * 200, "first-message", id="no-system"),
        pytest.param("s" * 5000, "q", "limit", id="preamble-past-prefix-chars"),
    ],
)
def test_without_a_preamble_share_the_first_message_always_joins_the_ring_key(
    system: str | None, question: str, ends_at: str
) -> None:
    messages = ([("system", system)] if system is not None else []) + [("user", question)]
    text = openai_text(CHAT, chat(*messages, ("assistant", "an answer"), ("user", "a follow-up")))
    preamble = 0 if system is None else len(ROLE_MARK["system"]) + len(system)
    first_message = min(4096, preamble + len(ROLE_MARK["user"]) + len(question))
    assert conversation_end(text, 4096, None) == (4096 if ends_at == "limit" else first_message)


@pytest.mark.parametrize(
    ("config", "system", "ring_bytes"),
    [
        pytest.param(
            KeyConfig(preamble_share=None),
            LONG_SYSTEM,
            len(ROLE_MARK["system"] + LONG_SYSTEM + ROLE_MARK["user"]) + 200,
            id="ends-at-the-first-message",
        ),
        pytest.param(
            KeyConfig(), LONG_SYSTEM, len(ROLE_MARK["system"] + LONG_SYSTEM), id="ends-at-the-preamble"
        ),
        pytest.param(KeyConfig(), "s" * 5000, 0, id="cut-at-prefix-chars"),
        pytest.param(KeyConfig(ring_key=RingKey.PREFIX), LONG_SYSTEM, 0, id="ring-key-prefix"),
    ],
)
def test_a_key_says_how_much_of_it_a_ring_key_ending_at_a_message_holds(
    config: KeyConfig, system: str, ring_bytes: int
) -> None:
    body = chat(("system", system), ("user", "q" * 200), ("assistant", "an answer"), ("user", "more"))
    assert key(CHAT, body, config=config).ring_bytes == ring_bytes


# A conversation's (question, answer) pairs.
TURNS = st.lists(
    st.tuples(st.text(min_size=1, max_size=400), st.text(min_size=1, max_size=400)), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(
    turns=TURNS,
    system=st.text(max_size=3000),
    tenant=st.none() | st.just("t1"),
)
def test_a_turns_previous_prompt_end_is_the_previous_turns_prompt_end(
    turns: list[tuple[str, str]], system: str, tenant: str | None
) -> None:
    """The index finds the backend that took turn k by turn k+1's `previous_prompt_end`."""
    messages: list[tuple[str, Any]] = [("system", system)]
    previous: RoutingKey | None = None
    for question, answer in turns:
        messages.append(("user", question))
        k = key(CHAT, chat(*messages), tenant)
        assert k.prompt_end != 0
        if previous is None:
            assert k.previous_prompt_end == 0
        else:
            assert k.previous_prompt_end == previous.prompt_end
        previous = k
        messages.append(("assistant", answer))


@settings(max_examples=40, deadline=None)
@given(
    turns=TURNS,
    instructions=st.none() | st.text(max_size=2000),
)
def test_a_stateless_responses_turn_finds_its_previous_turn_as_a_chat_does(
    turns: list[tuple[str, str]], instructions: str | None
) -> None:
    """A Responses client that keeps no state on the server sends the whole history as `input`, the
    answers as the output items it got back: turn k+1's `previous_prompt_end` is turn k's prompt end,
    and its own tail is counted, as for a chat."""
    items: list[dict[str, Any]] = []
    previous: RoutingKey | None = None
    for question, answer in turns:
        items.append({"role": "user", "content": question})
        body: dict[str, Any] = {"model": "m", "input": items, "store": False}
        if instructions is not None:
            body["instructions"] = instructions
        k = key("/v1/responses", body)
        assert k.prompt_end != 0
        assert k.previous_prompt_end == (0 if previous is None else previous.prompt_end)
        covered = k.blocks_end
        assert 0 <= k.own_tail <= k.size - covered
        previous = k
        items.append(
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}
        )


# An agent's turn: the model's output items (a reasoning summary, a message, function calls; at least
# one), each item's text.
# The answers' text leaves out the key material's own separators (\x1e, \x1f): an answer of several
# items, one of which holds a separator in its text, is not seen as one reply, so the previous
# prompt's end is not found and the turn is placed by its blocks alone (a limit the own-tail property
# works around too).
# (UTF-8 only: no lone surrogates, which `st.text()` leaves out too and a JSON body cannot carry.)
AGENT_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", blacklist_characters="\x1e\x1f"),
    min_size=1,
    max_size=300,
)
AGENT_ANSWERS = st.lists(
    st.lists(
        st.tuples(st.sampled_from(["reasoning", "message", "function_call"]), AGENT_TEXT),
        min_size=1,
        max_size=4,
    ),
    min_size=1,
    max_size=5,
)


def responses_output_item(kind: str, text: str, call_id: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {
            "type": "reasoning",
            "id": f"rs_{call_id}",
            "summary": [{"type": "summary_text", "text": text}],
        }
    if kind == "message":
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "run",
        "arguments": orjson.dumps({"cmd": text}).decode(),
    }


@settings(max_examples=60, deadline=None)
@given(
    answers=AGENT_ANSWERS,
    question=st.text(min_size=1, max_size=200),
    api=st.sampled_from(["chat", "responses"]),
)
def test_an_agents_turn_after_tool_calls_finds_its_previous_turn(
    answers: list[list[tuple[str, str]]], question: str, api: str
) -> None:
    """An agent's next request sends back what the model produced (reasoning, text, function calls)
    and the tools' results, with no new question: it is the previous prompt's next turn all the same,
    through the Responses API (its output items) as through chat (an assistant message with
    `tool_calls`, then `tool` messages)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": question}]
    previous: RoutingKey | None = None
    for turn, answer in enumerate([*answers, []]):
        if api == "chat":
            k = key(CHAT, {"model": "m", "messages": history})
        else:
            k = key(
                "/v1/responses", {"model": "m", "instructions": "Agent.", "input": history, "store": False}
            )
        assert k.prompt_end != 0
        assert k.previous_prompt_end == (0 if previous is None else previous.prompt_end)
        assert 0 <= k.own_tail <= k.size - k.blocks_end
        previous = k
        calls = [f"call_{turn}_{i}" for i, (kind, _) in enumerate(answer) if kind == "function_call"]
        if api == "chat":
            text = " ".join(t for kind, t in answer if kind != "function_call") or None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [
                    {"id": c, "type": "function", "function": {"name": "run", "arguments": "{}"}}
                    for c in calls
                ]
            history.append(message)
            history += [{"role": "tool", "tool_call_id": c, "content": f"result of {c}"} for c in calls]
        else:
            history += [
                responses_output_item(kind, t, f"call_{turn}_{i}") for i, (kind, t) in enumerate(answer)
            ]
            history += [
                {"type": "function_call_output", "call_id": c, "output": f"result of {c}"} for c in calls
            ]
        if not calls:
            history.append({"role": "user", "content": f"and then {turn}?"})


@pytest.mark.parametrize(
    ("earlier", "later"),
    [
        pytest.param(
            chat(("system", SYSTEM), ("user", "A?")),
            chat(("system", SYSTEM), ("user", "B?"), ("assistant", "b"), ("user", "more")),
            id="other-question",
        ),
        pytest.param(
            chat(("user", "A?")),
            chat(("user", "A?"), ("user", "B?"), ("assistant", "b"), ("user", "more")),
            id="one-more-message",
        ),
    ],
)
def test_another_conversations_prompt_is_not_a_previous_turn(
    earlier: dict[str, Any], later: dict[str, Any]
) -> None:
    assert key(CHAT, later).previous_prompt_end != key(CHAT, earlier).prompt_end
    other_tenant = key(CHAT, later, "t2").previous_prompt_end
    assert other_tenant != key(CHAT, later).previous_prompt_end


def test_only_chat_keys_carry_prompt_ends() -> None:
    native = key("/generate", {"prompt": "hello"})
    completion = key("/v1/completions", {"model": "m", "prompt": "hello"})
    assert (native.prompt_end, completion.prompt_end) == (0, 0)


@pytest.mark.parametrize(
    ("system_chars", "question_chars", "own"),
    [
        # 1,600 + 8 bytes of system message: blocks end at 256, 512, 1024, 1536; the question's whole
        # message (its separator and role too) lies past 1,536.
        pytest.param(1600, 100, "message", id="a-question-past-the-last-block"),
        # 1,200 + 8: the question's message starts at 1,208 and the last block ends at 1,536 inside
        # it: only what lies past the block is its own tail.
        pytest.param(1200, 500, "past-block", id="a-question-across-the-last-block-end"),
        # 1,528 + 8 = 1,536: the system message ends exactly at the last block's end.
        pytest.param(1528, 60, "message", id="a-question-right-after-a-block"),
        pytest.param(0, 40, "message", id="no-system-prompt-no-block"),
    ],
)
def test_a_chats_own_tail_is_its_last_message_past_the_last_block(
    system_chars: int, question_chars: int, own: str
) -> None:
    """The engine caches a prompt's last, unshared message too; the ledgers count it (own_tail)."""
    question = "q" * question_chars
    messages = [("system", "s" * system_chars)] if system_chars else []
    k = key(CHAT, chat(*messages, ("user", question)))
    covered = k.blocks_end
    message = len(ROLE_MARK["user"]) + question_chars
    assert k.own_tail == (message if own == "message" else k.size - covered)
    assert 0 < k.own_tail <= k.size - covered


@settings(max_examples=300)
@given(
    messages=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=700)),
        min_size=1,
        max_size=5,
    )
)
def test_an_own_tail_is_what_lies_past_the_blocks_from_the_last_reply_or_message_on(
    messages: list[tuple[str, str]],
) -> None:
    k = key(CHAT, chat(*messages))
    parts = [(ROLE_MARK[role] + content).encode("utf-8", "surrogatepass") for role, content in messages]
    starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
    assert k.size == sum(len(p) for p in parts)
    covered = k.blocks_end
    replies = [i for i, (role, _) in enumerate(messages) if role == "assistant"]
    if replies:
        # From the last reply on (a run of assistant messages is one reply, as some clients send one
        # answer's text and its tool calls): the previous turn's prompt ended there.
        first = replies[-1]
        while first - 1 in replies:
            first -= 1
        separators = any(ROLE_MARK["assistant"] in content for _, content in messages) or any(
            "\x1e" in messages[i][1] for i in range(first, replies[-1])
        )
        if not separators:
            assert k.own_tail == k.size - max(covered, starts[first])
    else:
        # The last message; a separator in its content only makes it shorter.
        whole = k.size - max(covered, starts[-1])
        assert 0 <= k.own_tail <= whole
        if "\x1e" not in messages[-1][1]:
            assert k.own_tail == whole


def test_a_prompt_that_ends_on_a_block_end_has_no_own_tail() -> None:
    k = key(CHAT, chat(("system", "s" * 1000), ("user", "q" * (1536 - 1008 - 6))))
    assert k.size == 1536 and k.own_tail == 0


def test_completions_and_native_keys_have_no_own_tail() -> None:
    assert key("/v1/completions", {"model": "m", "prompt": "hello " * 100}).own_tail == 0
    assert key("/generate", {"text": "hello " * 100}).own_tail == 0


def _common_prefix_len(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("split", [pytest.param(n, id=str(n)) for n in (100, 256, 1000, 3000, 9000)])
def test_keys_sharing_a_prefix_share_leading_blocks(split: int) -> None:
    base = "".join(chr(0x61 + i % 26) for i in range(split))
    da, db = chat(("user", base + "A" * 3000)), chat(("user", base + "B" * 3000))
    a, b = key(CHAT, da), key(CHAT, db)
    common = _common_prefix_len(openai_text(CHAT, da).encode(), openai_text(CHAT, db).encode())
    shared = sum(1 for end in block_ends(DEFAULT.block_bytes, DEFAULT.max_key_bytes) if end <= common)
    assert a.blocks[:shared] == b.blocks[:shared]
    assert a.blocks[shared] != b.blocks[shared]


def test_blocks_follow_a_growing_conversation() -> None:
    turn1 = chat(("system", SYSTEM), ("user", "first question"))
    turn2 = chat(("system", SYSTEM), ("user", "first question"), ("assistant", "answer"), ("user", "next"))
    a, b = key(CHAT, turn1), key(CHAT, turn2)
    assert a.ring_hash == b.ring_hash  # a conversation keeps its ring position over its turns
    prefix_only = KeyConfig(ring_key=RingKey.PREFIX)
    assert key(CHAT, turn1, config=prefix_only).ring_hash != key(CHAT, turn2, config=prefix_only).ring_hash
    assert len(a.blocks) >= 2
    assert b.blocks[: len(a.blocks)] == a.blocks


def test_blocks_bounded_by_max_key_bytes() -> None:
    config = KeyConfig(block_bytes=16, max_key_bytes=1000)
    k = key(CHAT, chat(("user", "x" * 1_000_000)), config=config)
    assert len(k.blocks) == len(block_ends(16, 1000))


def test_short_key_has_no_blocks() -> None:
    assert key(CHAT, chat(("user", "hi"))).blocks == ()


@settings(max_examples=100)
@given(st.integers(1, 512), st.integers(0, 200_000), st.integers(0, 200_000))
def test_block_ends_depend_only_on_position(first: int, l1: int, l2: int) -> None:
    short, long = block_ends(first, min(l1, l2)), block_ends(first, max(l1, l2))
    assert long[: len(short)] == short
    assert all(0 < e <= max(l1, l2) for e in long)
    sizes = [b - a for a, b in zip((0, *long), long, strict=False)]
    assert sizes[:2] == [first] * len(sizes[:2])  # two blocks at each size, then double
    assert all(s in {first * 2**i for i in range(7)} for s in sizes)
    assert sizes == sorted(sizes)


def test_block_ends_doubling_table() -> None:
    ends = block_ends(10, 10_000)
    assert ends[:9] == (10, 20, 40, 60, 100, 140, 220, 300, 460)
    sizes = {b - a for a, b in itertools.pairwise(ends)}
    assert max(sizes) == 640  # capped at 64x


# -- completions, responses, embeddings ----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "a", "b"),
    [
        pytest.param("/v1/completions", {"prompt": "p1"}, {"prompt": "p2"}, id="completions-str"),
        pytest.param("/v1/completions", {"prompt": ["a", "b"]}, {"prompt": ["ab"]}, id="completions-list"),
        pytest.param("/v1/completions", {"prompt": [1, 2, 3]}, {"prompt": [1, 2, 4]}, id="token-ids"),
        pytest.param(
            "/v1/completions", {"prompt": [[1, 2], [3]]}, {"prompt": [[1], [2, 3]]}, id="token-batches"
        ),
        pytest.param("/v1/completions", {"prompt": [12]}, {"prompt": [1, 2]}, id="token-boundaries"),
        pytest.param(
            "/v1/responses",
            {"instructions": "A", "input": "q"},
            {"instructions": "B", "input": "q"},
            id="instructions",
        ),
        pytest.param("/v1/responses", {"input": "q1"}, {"input": "q2"}, id="responses-input"),
        pytest.param(
            "/v1/responses",
            {"input": [{"role": "user", "content": "x"}]},
            {"input": [{"role": "user", "content": "y"}]},
            id="responses-input-messages",
        ),
        pytest.param("/v1/embeddings", {"input": "e1"}, {"input": "e2"}, id="embeddings-str"),
        pytest.param("/v1/embeddings", {"input": ["a", "b"]}, {"input": ["a", "c"]}, id="embeddings-list"),
        pytest.param("/v1/embeddings", {"input": [1, 2]}, {"input": [1, 3]}, id="embeddings-tokens"),
    ],
)
def test_openai_endpoints_key_on_their_prompt(path: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    ka, kb = key(path, {**a, "model": "m"}), key(path, {**b, "model": "m"})
    assert ka.source is kb.source is KeySource.OPENAI
    assert ka.ring_hash != kb.ring_hash
    assert key(path, {"temperature": 0.3, **a, "model": "m"}) == ka


def test_responses_instructions_then_input() -> None:
    text = openai_text("/v1/responses", {"input": "INPUT", "instructions": "INSTR"})
    assert 0 <= text.index("INSTR") < text.index("INPUT")


def test_completions_prompt_forms() -> None:
    assert (
        key("/v1/completions", {"prompt": "x"}).ring_hash == key("/v1/completions", {"prompt": "x"}).ring_hash
    )
    assert openai_text("/v1/completions", {"prompt": [[1, 2], [3]]}).count("1") == 1
    token_text = openai_text("/v1/completions", {"prompt": [101, 7592]})
    assert "101" in token_text
    assert "7592" in token_text


# -- native paths and mode forcing ---------------------------------------------------------------


def test_native_key_is_canonical_and_order_invariant() -> None:
    a = key("/generate", b'{"prompt":"once upon","sampling_params":{"temperature":0.1,"top_p":1}}')
    b = key("/generate", b'{ "sampling_params" : {"top_p":1, "temperature":0.1}, "prompt" : "once upon" }')
    assert a.source is KeySource.NATIVE
    assert a == b
    assert a != key("/generate", b'{"prompt":"once upon a time"}')


def test_native_key_ignores_sampling_params() -> None:
    a = key("/generate", {"prompt": "p", "temperature": 0.1})
    b = key("/generate", {"temperature": 0.9, "prompt": "p", "max_tokens": 5})
    assert a.ring_hash == b.ring_hash


def test_native_without_prompt_fields_uses_whole_canonical_body() -> None:
    a = key("/pooling", b'{"b":1,"a":[1,2]}')
    assert a == key("/pooling", b'{"a":[1,2],"b":1}')
    assert a.source is KeySource.NATIVE
    assert a.ring_hash != key("/pooling", b'{"a":[1,2],"b":2}').ring_hash


def test_native_prefix_bytes() -> None:
    config = KeyConfig(prefix_bytes=32, block_bytes=16)
    a = key("/generate", {"prompt": "x" * 100 + "a" + "z" * 100}, config=config)
    b = key("/generate", {"prompt": "x" * 100 + "b" + "z" * 100}, config=config)
    assert a.ring_hash == b.ring_hash
    assert a.blocks[:4] == b.blocks[:4]
    assert a.blocks != b.blocks  # the blocks see the whole prompt, not only prefix_bytes
    assert key("/generate", {"prompt": "y" * 100}, config=config).ring_hash != a.ring_hash


def test_mode_forcing() -> None:
    body = chat(("user", "hi"))
    assert key(CHAT, body).source is KeySource.OPENAI
    assert key("/generate", body).source is KeySource.NATIVE
    assert key(CHAT, body, config=KeyConfig(mode=KeyMode.NATIVE)).source is KeySource.NATIVE
    assert key("/generate", body, config=KeyConfig(mode=KeyMode.OPENAI)).source is KeySource.OPENAI
    assert (
        key("/generate", body, config=KeyConfig(mode=KeyMode.OPENAI)).ring_hash == key(CHAT, body).ring_hash
    )


def test_openai_path_without_prompt_falls_back_to_native() -> None:
    assert key(CHAT, {"model": "m", "messages": []}).source is KeySource.NATIVE
    assert key(CHAT, {"model": "m", "messages": "not a list"}).source is KeySource.NATIVE


def test_raw_source_for_non_json() -> None:
    a = key("/generate", b"plain text prompt")
    assert a.source is KeySource.RAW
    assert a == key("/generate", b"plain text prompt")
    assert a != key("/generate", b"plain text prompt 2")
    config = KeyConfig(prefix_bytes=8)
    assert (
        key("/x", b"12345678abc", config=config).ring_hash
        == key("/x", b"12345678xyz", config=config).ring_hash
    )


# -- bad input never raises ----------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(CHAT, b"", id="empty"),
        pytest.param(CHAT, b"{not json", id="invalid-json"),
        pytest.param(CHAT, b"\xff\xfe\x00garbage", id="non-utf8"),
        pytest.param(CHAT, b'{"messages":[{"role":"user","content":"\\ud800"}]}', id="lone-surrogate"),
        pytest.param(CHAT, DEEP, id="100k-deep"),
        pytest.param(CHAT, b'{"messages":' + DEEP + b"}", id="100k-deep-messages"),
        pytest.param(CHAT, b'{"messages":"hello"}', id="messages-str"),
        pytest.param(CHAT, b'{"messages":{"role":"user"}}', id="messages-object"),
        pytest.param(CHAT, b'{"messages":[null,1,"x",[]]}', id="messages-junk-items"),
        pytest.param(CHAT, b'{"messages":[{"role":5,"content":{"a":1},"name":3}]}', id="wrong-types"),
        pytest.param(CHAT, b'{"messages":[{"role":"user","content":null}]}', id="content-null"),
        pytest.param(
            CHAT, b'{"messages":[{"role":"user","content":[1,null,{"type":"text"}]}]}', id="parts-junk"
        ),
        pytest.param(CHAT, b'[{"role":"user","content":"hi"}]', id="array-body"),
        pytest.param(CHAT, b'"just a string"', id="string-body"),
        pytest.param(CHAT, b"null", id="null-body"),
        pytest.param(CHAT, b'{"model":["m"],"prompt_cache_key":{}}', id="model-and-tenant-wrong-types"),
        pytest.param("/v1/completions", b'{"prompt":[null,{"a":1},[[]]]}', id="prompt-junk"),
        pytest.param("/v1/completions", b'{"prompt":123456789012345678901234567890}', id="prompt-big-int"),
        pytest.param("/v1/responses", b'{"instructions":1,"input":{"x":1}}', id="responses-junk"),
        pytest.param("/v1/embeddings", b'{"input":[1.5,true,null]}', id="embeddings-junk"),
        pytest.param("/generate", b'{"prompt":' + b"[" * 300 + b"]" * 300 + b"}", id="native-unencodable"),
        pytest.param("/generate", b"x" * 5_000_000, id="huge-raw"),
        pytest.param(CHAT, orjson.dumps(chat(("user", "x" * 3_000_000))), id="huge-chat"),
        pytest.param(
            CHAT,
            b'{"messages":[{"role":"user","content":[' + b"[" * 300 + b"]" * 300 + b"]}]}",
            id="part-300",
        ),
    ],
)
def test_bad_input_never_raises(path: str, body: bytes) -> None:
    k = extract_key(path, body, None, DEFAULT)
    assert isinstance(k, RoutingKey)
    assert 0 <= k.ring_hash < 2**64
    assert k == extract_key(path, body, None, DEFAULT)


def _deep_part(field: str) -> bytes:
    nest = b"[" * 1000 + b"]" * 1000
    if field == "content":
        return b'{"messages":[{"role":"user","content":[' + nest + b"]}]}"
    return b'{"messages":[],"' + field.encode() + b'":' + nest + b"}"


@pytest.mark.parametrize("field", [pytest.param(f, id=f) for f in ("content", "tools")])
def test_deep_but_parseable_parts_never_raise(field: str) -> None:
    k = extract_key(CHAT, _deep_part(field), None, DEFAULT)
    assert isinstance(k, RoutingKey)


PATHS = st.sampled_from(
    [CHAT, "/v1/completions", "/v1/responses", "/v1/embeddings", "/generate", "/", ""]
) | st.text(max_size=20)


@settings(max_examples=300)
@given(PATHS, st.binary(max_size=200), st.none() | st.text(max_size=8), st.sampled_from(list(KeyMode)))
def test_extract_key_never_raises_on_bytes(path: str, body: bytes, tenant: str | None, mode: KeyMode) -> None:
    assert isinstance(extract_key(path, body, tenant, KeyConfig(mode=mode, block_bytes=16)), RoutingKey)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    [
        "messages",
        "prompt",
        "input",
        "instructions",
        "tools",
        "model",
        "prompt_cache_key",
        "role",
        "content",
        "text",
    ]
)
MESSAGE = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls", "tool_call_id", "type"]), JSONISH
)


@settings(max_examples=150)
@given(
    PATHS,
    st.dictionaries(FIELDS, JSONISH | st.lists(MESSAGE, max_size=3), max_size=5),
    st.sampled_from(list(KeyMode)),
)
def test_extract_key_never_raises_on_json_shaped_junk(path: str, doc: dict[str, Any], mode: KeyMode) -> None:
    body = json.dumps(doc).encode()  # NaN, Infinity and huge ints included on purpose
    assert isinstance(extract_key(path, body, None, KeyConfig(mode=mode, block_bytes=16)), RoutingKey)
