"""Streamed text under invalid or split UTF-8 output (a random-weight model emits arbitrary bytes).

The backend here is a scripted ``GenerationBackend`` (the engine side of the
HTTP layer) so the bytes are known; the HTTP server, SSE framing and the
byte-level tokenizer are the real ones.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from disagg.api.app import create_app
from disagg.config import load_config
from disagg.engine.factory import build_tokenizer
from disagg.messages import StreamChunk
from tests.helpers import serve_asgi

OFFSET = 4  # the byte tokenizer's id of byte b is b + OFFSET


class Scripted:
    model_name = "disagg-tiny"
    max_model_len = 4096

    def __init__(self, byte_seq: list[int]):
        self.tokenizer = build_tokenizer(load_config({"model": {"name": "tiny"}}))
        self.bytes = byte_seq

    async def stream(self, params):
        for i, b in enumerate(self.bytes):
            await asyncio.sleep(0.01)
            last = i == len(self.bytes) - 1
            yield StreamChunk([b + OFFSET], last, "length" if last else None, len(params.prompt_token_ids))

    async def stats(self) -> dict:
        return {}


def _events(url: str, n: int) -> list[str]:
    body = {"model": "disagg-tiny", "prompt": [10, 11, 12], "max_tokens": n, "stream": True}
    texts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["finish_reason"] is None:
                    texts.append(choices[0]["text"])
    return texts


def test_invalid_byte_does_not_hold_back_the_rest_of_the_stream():
    seq = [0xFF] + [ord(c) for c in "abcdefghij"]  # 0xFF is never valid UTF-8
    with serve_asgi(create_app(Scripted(seq))) as url:
        texts = _events(url, len(seq))
    assert "".join(texts) == "\ufffdabcdefghij"
    assert len(texts) >= 7  # one event per token once the bad byte is settled, not one burst at the end


def test_tokens_without_bytes_stream_one_event_each():
    """A random-weight model mostly samples ids past the byte range: each is a final replacement character."""
    seq = [300 - OFFSET, 301 - OFFSET, ord("a"), 400 - OFFSET, 500 - OFFSET, 0xE2, ord("b")]
    with serve_asgi(create_app(Scripted(seq))) as url:
        texts = _events(url, len(seq))
    assert "".join(texts) == "\ufffd\ufffda\ufffd\ufffd\ufffdb"
    assert len(texts) == len(seq) - 1  # only the lead byte 0xE2 waited (for "b", which settled it)


def test_split_multibyte_character_is_held_until_complete():
    seq = [ord("x"), 0xE2, 0x82, 0xAC, ord("y")]  # "x€y", the euro sign split over three tokens
    with serve_asgi(create_app(Scripted(seq))) as url:
        texts = _events(url, len(seq))
    assert "".join(texts) == "x\u20acy"
    assert "\ufffd" not in "".join(texts) and "\u20ac" in texts


class ScriptedEnd(Scripted):
    """Every byte as a token, then a final chunk without tokens (as a backend may end a stream)."""

    async def stream(self, params):
        for b in self.bytes:
            await asyncio.sleep(0.01)
            yield StreamChunk([b + OFFSET], False, None, len(params.prompt_token_ids))
        yield StreamChunk([], True, "length", len(params.prompt_token_ids))


def test_text_held_at_the_end_of_the_stream_is_sent():
    seq = [ord("x"), 0xE2, 0x82]  # ends inside the euro sign: nothing can complete it now
    backend = ScriptedEnd(seq)
    with serve_asgi(create_app(backend)) as url:
        texts = _events(url, len(seq))
        whole = httpx.post(url + "/v1/completions", json={"model": "disagg-tiny", "prompt": [10, 11, 12],
                                                          "max_tokens": len(seq)}, timeout=30).json()
    expected = backend.tokenizer.decode([b + OFFSET for b in seq])
    assert "".join(texts) == whole["choices"][0]["text"] == expected == "x\ufffd"
