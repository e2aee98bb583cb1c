"""Mooncake-format traces become chat workloads whose shared hash ids are exactly shared text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefix_router.loadgen.traces import (
    MOONCAKE_BLOCK_TOKENS,
    BlockText,
    TraceError,
    TraceRecord,
    guess_block_tokens,
    guess_time_unit_s,
    parse_record,
    read_trace,
    trace_workload,
)
from prefix_router.loadgen.workloads import oracle_hit_rate, prompt_blocks

SAMPLE = Path(__file__).parents[2] / "benchmarks" / "traces" / "mooncake_conversation_head2000.jsonl"
SYNTHETIC = SAMPLE.with_name("mooncake_synthetic_head2000.jsonl")


def record(ts: float, hash_ids: list[int], input_length: int | None = None, **extra: int) -> TraceRecord:
    n = input_length if input_length is not None else 512 * len(hash_ids)
    return parse_record(
        {"timestamp": ts, "input_length": n, "output_length": 40, "hash_ids": hash_ids, **extra}
    )


def content(body: dict[str, object]) -> str:
    messages = body["messages"]
    assert isinstance(messages, list)
    [message] = messages
    assert message["role"] == "user"
    return str(message["content"])


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_equal_leading_ids_share_exactly_those_blocks() -> None:
    w = trace_workload([record(0, [0, 1, 2]), record(10, [0, 1, 3]), record(20, [5, 1, 2])])
    a, b, c = (content(r.body) for r in w.requests)
    assert len(a) == len(b) == 3 * 512 * 4  # exact token counts at 4 characters a token
    assert a[: 2 * 2048] == b[: 2 * 2048] and a[2 * 2048 :] != b[2 * 2048 :]
    assert common_prefix(a, c) < 2048  # a different first id: nothing shared, whatever follows
    # In the sim's own 16-token blocks (after the 2-token "<|user|>" of the chat rendering):
    # the requests share every block that lies inside the two common 512-token blocks.
    _, ha = prompt_blocks(w.requests[0].body, 16)
    _, hb = prompt_blocks(w.requests[1].body, 16)
    shared = (2 + 2 * 512) // 16
    assert ha[:shared] == hb[:shared] and ha[shared] != hb[shared]


def test_the_last_block_is_partial_and_a_prefix_of_its_full_text() -> None:
    text = BlockText(MOONCAKE_BLOCK_TOKENS, seed=3)
    prompt = text.prompt((7, 8, 9), 512 * 2 + 100)
    assert len(prompt) == (512 * 2 + 100) * 4
    assert prompt[-400:] == text.full(9)[:400]
    assert len(text.full(9)) == 2048 and text.full(9) == BlockText(512, seed=3).full(9)
    assert BlockText(512, seed=4).full(9) != text.full(9)  # the layout's seed changes every id's text


def test_oracle_counts_the_shared_blocks_of_a_trace() -> None:
    w = trace_workload([record(0, [0, 1, 2]), record(10, [0, 1, 3])])
    result = oracle_hit_rate(w, block_size=16, capacity_blocks=None)
    assert result.hit_tokens == (2 + 2 * 512) // 16 * 16
    # "<|user|>" (8 bytes) before and "<|assistant|>" (13) after each prompt, 4 bytes a token, rounded up.
    assert result.prompt_tokens == 2 * -(-(8 + 3 * 2048 + 13) // 4)


def test_times_are_scaled_from_the_first_request_and_output_capped() -> None:
    records = [record(5000, [0]), record(5500, [0, 1]), record(7000, [0, 2])]
    w = trace_workload(records, time_unit_s=0.001, time_scale=0.1, max_output_tokens=16)
    assert [r.at_s for r in w.requests] == pytest.approx([0.0, 0.05, 0.2])
    assert all(r.body["max_tokens"] == 16 for r in w.requests)
    assert [r.group for r in w.requests] == ["h0", "h0-1", "h0-2"]  # a conversation: its first two ids
    assert all(r.after is None for r in w.requests)  # Mooncake's format names no parents
    with pytest.raises(ValueError, match="time_scale"):
        trace_workload(records, time_scale=0)


def test_bailian_chat_ids_chain_turns_and_name_their_conversation() -> None:
    records = [
        record(0.0, [1, 2], chat_id=10, parent_chat_id=-1, turn=1),
        record(1.5, [3], chat_id=11, parent_chat_id=-1, turn=1),
        record(4.0, [1, 2, 4], chat_id=12, parent_chat_id=10, turn=2),
        record(9.0, [1, 2, 4, 5], chat_id=13, parent_chat_id=12, turn=3),
        record(9.5, [6], chat_id=14, parent_chat_id=99, turn=2),  # its parent is not in the sample
    ]
    assert guess_time_unit_s(records) == 1.0
    w = trace_workload(records, block_tokens=16, time_unit_s=1.0)
    assert [r.group for r in w.requests] == ["chat10", "chat11", "chat10", "chat10", "chat99"]
    assert [r.after for r in w.requests] == [None, None, 0, 2, None]
    assert [r.at_s for r in w.requests] == pytest.approx([0.0, 1.5, 4.0, 9.0, 9.5])
    assert len(content(w.requests[2].body)) == 3 * 16 * 4


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param("[1, 2]", "JSON object", id="not-an-object"),
        pytest.param('{"timestamp": 0, "input_length": 5, "output_length": 1}', "hash_ids", id="no-ids"),
        pytest.param(
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}',
            "hash_ids",
            id="empty-ids",
        ),
        pytest.param(
            '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            "timestamp",
            id="negative-time",
        ),
        pytest.param(
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "input_length",
            id="empty-prompt",
        ),
        pytest.param(
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
            "hash_ids",
            id="text-id",
        ),
        pytest.param(
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "chat_id": "x"}',
            "chat_id",
            id="text-chat-id",
        ),
        pytest.param("{not json", "not JSON", id="bad-json"),
    ],
)
def test_a_bad_line_is_named_with_its_number(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})
    path = tmp_path / "trace.jsonl"
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError, match=f"line 3: .*{message}"):
        read_trace(path)
    assert len(read_trace(path, limit=1)) == 1  # the limit stops before the bad line


def test_block_size_comes_from_a_bailian_file_name() -> None:
    assert guess_block_tokens(Path("qwen_traceA_blksz_16.jsonl")) == 16
    assert guess_block_tokens(SAMPLE) == MOONCAKE_BLOCK_TOKENS


def test_the_shipped_mooncake_sample_replays() -> None:
    records = read_trace(SAMPLE)
    assert len(records) == 2000
    assert all(r.hash_ids[0] == 0 for r in records)  # one shared first block: the Mooncake shape
    assert guess_time_unit_s(records) == 0.001
    w = trace_workload(records[:50], time_scale=0.1)
    for r, rec in zip(w.requests, records[:50], strict=True):
        assert len(content(r.body)) == rec.input_length * 4
    first = content(w.requests[0].body)
    assert all(content(r.body)[:2048] == first[:2048] for r in w.requests)


def test_the_shipped_synthetic_sample_replays_its_conversations_as_shared_text() -> None:
    records = read_trace(SYNTHETIC)
    assert len(records) == 2000
    assert guess_block_tokens(SYNTHETIC) == MOONCAKE_BLOCK_TOKENS
    assert guess_time_unit_s(records) == 0.001
    w = trace_workload(records[:400], time_scale=0.1)
    texts = [content(r.body) for r in w.requests]
    block_chars = MOONCAKE_BLOCK_TOKENS * 4
    # A later request that starts with an earlier one's leading ids carries that request's text there,
    # so the router can find it: the trace's reuse, not a preamble shared by all, is what to route on.
    later_turns = 0
    for j, rec in enumerate(records[:400]):
        for i in range(j):
            earlier = records[i].hash_ids
            common = next(
                (k for k, (a, b) in enumerate(zip(earlier, rec.hash_ids, strict=False)) if a != b), None
            )
            common = min(len(earlier), len(rec.hash_ids)) if common is None else common
            if common >= 2:
                shared = (common - 1) * block_chars  # the last common block may end either prompt
                assert texts[j][:shared] == texts[i][:shared]
                later_turns += 1
                break
    assert later_turns >= 10
    assert len({r.hash_ids[0] for r in records}) > 1500  # no first block shared by all
