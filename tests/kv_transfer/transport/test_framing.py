from __future__ import annotations

import pytest

from kv_transfer.transport.framing import (
    CHUNK_HEADER_BYTES,
    MAX_KEY_BYTES,
    Chunk,
    FlagBatch,
    FramingError,
    KeyBatch,
    Reassembler,
    ServerStats,
    chunk_object,
    miss_chunk,
)


def test_key_batch_round_trip() -> None:
    keys = ["mla:" + "ab" * 16, "kda:" + "cd" * 16 + ":tp0of8", "é"]
    assert KeyBatch.decode(KeyBatch(keys).encode()).keys == keys
    assert KeyBatch.decode(KeyBatch([]).encode()).keys == []


@pytest.mark.parametrize(
    "frame",
    [b"", b"\x01\x00\x00", b"\x01\x00\x00\x00\x05\x00ab", b"\x00\x00\x00\x00\x00"],
    ids=["empty", "short-count", "truncated-key", "trailing-bytes"],
)
def test_key_batch_rejects_malformed(frame: bytes) -> None:
    with pytest.raises(FramingError):
        KeyBatch.decode(frame)


def test_keys_must_be_short_and_non_empty() -> None:
    with pytest.raises(ValueError):
        KeyBatch([""]).encode()
    with pytest.raises(ValueError):
        KeyBatch(["x" * (MAX_KEY_BYTES + 1)]).encode()


def test_flag_batch_round_trip() -> None:
    assert FlagBatch.decode(FlagBatch([True, False, True]).encode()).flags == [True, False, True]
    with pytest.raises(FramingError):
        FlagBatch.decode(b"\x02")


def test_chunking_tiles_the_object() -> None:
    data = bytes(range(256)) * 10  # 2560 bytes
    chunks = list(chunk_object("k", data, 1000))
    assert [(c.offset, len(c.payload)) for c in chunks] == [(0, 1000), (1000, 1000), (2000, 560)]
    assert [c.is_last for c in chunks] == [False, False, True]
    assert all(c.total_bytes == 2560 for c in chunks)
    frames = [c.encode() for c in chunks]
    assert len(frames[0]) == CHUNK_HEADER_BYTES + 1 + 1000
    assembler = Reassembler(max_object_bytes=10_000)
    results = [assembler.feed(Chunk.decode(f)) for f in frames]
    assert results == [None, None, ("k", data)]
    assert assembler.pending_key is None


def test_empty_object_and_miss_are_single_frames() -> None:
    assembler = Reassembler(max_object_bytes=10)
    (empty,) = chunk_object("e", b"", 4)
    assert assembler.feed(Chunk.decode(empty.encode())) == ("e", b"")
    assert assembler.feed(Chunk.decode(miss_chunk("m").encode())) == ("m", None)


def test_reassembler_rejects_gaps_interleaving_and_oversize() -> None:
    a = list(chunk_object("a", b"x" * 30, 10))
    b = list(chunk_object("b", b"y" * 30, 10))
    with pytest.raises(FramingError, match="gap"):
        r = Reassembler(100)
        r.feed(a[0])
        r.feed(a[2])
    with pytest.raises(FramingError, match="interrupted"):
        r = Reassembler(100)
        r.feed(a[0])
        r.feed(b[0])
    with pytest.raises(FramingError, match="starts at offset"):
        Reassembler(100).feed(a[1])
    with pytest.raises(FramingError, match="exceeds"):
        Reassembler(29).feed(a[0])


def test_chunk_decode_bounds_payload_by_total() -> None:
    frame = Chunk("k", 5, 0, b"123456").encode()
    with pytest.raises(FramingError, match="beyond total"):
        Chunk.decode(frame)
    assert "123" not in repr(Chunk("k", 3, 0, b"123"))


def test_server_stats_json_keeps_unknown_counters() -> None:
    stats = ServerStats(store_name="host", num_fetch_hits=3)
    wire = stats.encode()[:-1] + b', "num_future": 7}'
    decoded = ServerStats.decode(wire)
    assert decoded.num_fetch_hits == 3 and decoded.extra == {"num_future": 7}
