"""SSE parsing: token stamps per read, usage, ends and errors, fast paths against the events."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.tools.bench.client import RequestResult
from disagg.tools.bench.sse import StreamAccumulator, all_plain_tokens


def _event(obj: object, crlf: bool = False) -> bytes:
    end = b"\r\n\r\n" if crlf else b"\n\n"
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + end


def token(text: str = " x", usage_null: bool = False) -> bytes:
    obj: dict = {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    if usage_null:
        obj["usage"] = None
    return _event(obj)


FINISH = _event({"id": "c", "choices": [{"index": 0, "text": " y", "finish_reason": "length"}]})
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
DONE = b"data: [DONE]\n\n"
# Events around plain token chunks (with the number of tokens each carries).
OTHERS = {
    "finish": (FINISH, 1),
    "usage": (USAGE, 0),
    "comment": (b": keep-alive\n\n", 0),
    "two_choices": (
        _event({"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}),
        2,
    ),
    "quoted_key_in_text": (token('say "text": "finish_reason":null'), 1),
    "crlf": (_event({"choices": [{"index": 0, "text": "z", "finish_reason": None}]}, True), 1),
    "usage_null": (token(usage_null=True), 1),
    "empty_text": (token(""), 1),
}


def _feed(parts: list[bytes], chat: bool = False) -> RequestResult:
    result = RequestResult("r", 0)
    acc = StreamAccumulator(result, chat)
    for k, part in enumerate(parts):
        if acc.feed(part, 100 + k):
            break
    acc.close()
    return result


def test_tokens_usage_and_end_one_read() -> None:
    r = _feed([token() * 3 + FINISH + USAGE + DONE])
    assert r.ok and r.chunk_ns == [100] * 4 and r.output_tokens == 4
    assert (r.prompt_tokens, r.first_token_ns, r.end_ns) == (9, 100, 100)


def test_each_event_takes_the_stamp_of_the_read_that_completes_it() -> None:
    body = token() + token() + FINISH + DONE
    cut = len(token()) + 5  # inside the second event
    r = _feed([body[:cut], body[cut:]])
    assert r.chunk_ns == [100, 101, 101] and r.ok


def test_ended_early_and_error_event() -> None:
    r = _feed([token() * 2])
    assert r.error == "stream_broken" and "ended early" in r.error_detail
    r = _feed([token() + _event({"error": {"message": "oom"}}) + token()])
    assert r.error == "stream_broken" and "oom" in r.error_detail and len(r.chunk_ns) == 1


def test_chat_deltas() -> None:
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    content = _event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    think = _event({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})
    end = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    r = _feed([role + think + content + end + DONE], chat=True)
    assert r.ok and len(r.chunk_ns) == 2


# Plain token chunks in disguise: quotes inside a string are escaped, so a key pattern
# in the text does not match; "usage":null and empty text change nothing.
PLAIN_TOO = {"quoted_key_in_text", "usage_null", "empty_text"}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_bulk_count_takes_only_plain_tokens(name: str) -> None:
    event, _ = OTHERS[name]
    plain = token() * 3
    assert all_plain_tokens(plain) == 3
    expected = 4 if name in PLAIN_TOO else 0
    assert all_plain_tokens(plain + event) == expected
    assert all_plain_tokens(event + plain) == expected


@settings(max_examples=100, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["plain", *sorted(OTHERS)]), min_size=1, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
)
def test_any_mix_split_anywhere_counts_every_token(kinds: list[str], cuts: list[int]) -> None:
    body, tokens, stamps = b"", 0, []
    for kind in kinds:
        event, n = (token(), 1) if kind == "plain" else OTHERS[kind]
        body += event
        tokens += n
    body += FINISH + USAGE + DONE
    points = sorted({c % (len(body) + 1) for c in cuts})
    parts = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    r = _feed(parts)
    assert r.ok and len(r.chunk_ns) == tokens + 1
    assert r.output_tokens == 4  # from usage
    # stamps never decrease and each is a read's stamp
    stamps = r.chunk_ns
    assert stamps == sorted(stamps) and set(stamps) <= set(range(100, 100 + len(parts)))


def test_a_crlf_blank_line_split_between_its_cr_and_lf_completes_its_event_on_time() -> None:
    """A read ends between the CR and the LF that close an event: the event completes with the
    read that brings the LF, not one event later (a first token one ITL late inflates TTFT)."""
    tok = b'data: {"choices":[{"index":0,"text":" a","finish_reason":null}]}\r\n\r\n'
    last = b'data: {"choices":[{"index":0,"text":" b","finish_reason":"length"}]}\r\n\r\n'
    r = RequestResult("r", 0)
    acc = StreamAccumulator(r, chat=False)
    acc.feed(tok[:-1], 10)
    acc.feed(b"\n", 11)
    acc.feed(last, 50)
    acc.feed(b"data: [DONE]\r\n\r\n", 51)
    acc.close()
    assert r.chunk_ns == [11, 50] and r.output_tokens == 2
