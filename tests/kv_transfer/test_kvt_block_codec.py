"""Codec version 2 (the checksum algorithm in the header) and the full-block hot path (BlockCodec)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from kvt_util import bit_equal, kda_shard, mla_block, small_layout

from kv_transfer import checksum, codec
from kv_transfer.dcp import split_dcp
from kv_transfer.errors import CorruptObjectError

LAYOUT = small_layout()


def _with_algo(algo: int):
    """Encode with ``algo`` as this build's write algorithm (restored afterwards)."""

    class _Ctx:
        def __enter__(self):
            self.saved = checksum.WRITE_ALGO
            checksum.WRITE_ALGO = algo
            codec.block_codec.cache_clear()

        def __exit__(self, *exc):
            checksum.WRITE_ALGO = self.saved
            codec.block_codec.cache_clear()

    return _Ctx()


@pytest.mark.parametrize("algo", [checksum.CRC32, checksum.CRC32C])
def test_the_header_records_the_checksum_and_any_build_reads_it(algo: int) -> None:
    blk = mla_block(LAYOUT, 16, 16, seed=2)
    with _with_algo(algo):
        buf = codec.encode(blk, LAYOUT)
    assert (buf[4], buf[5]) == (codec.FORMAT_VERSION, algo)
    header = codec.verify(buf)
    assert header.checksum == algo
    end = codec.HEADER_BYTES + header.payload_len
    assert struct.unpack_from("<I", buf, end)[0] == checksum.compute(algo, bytes(buf[:end]))
    assert bit_equal(codec.decode_mla(buf, LAYOUT).rows, blk.rows)  # whatever this build writes


def test_version_1_objects_still_decode_and_a_bad_algorithm_byte_is_corrupt() -> None:
    blk = mla_block(LAYOUT, 0, 16, seed=5)
    with _with_algo(checksum.CRC32):
        buf = bytearray(codec.encode(blk, LAYOUT))
    end = len(buf) - codec.TRAILER_BYTES
    buf[4:6] = struct.pack("<H", 1)  # a version-1 writer: a two-byte version, CRC-32 implied
    struct.pack_into("<I", buf, end, zlib.crc32(buf[:end]))
    header = codec.verify(buf)
    assert header.checksum == checksum.CRC32
    assert bit_equal(codec.decode_mla(buf, LAYOUT).rows, blk.rows)
    buf[5] = 9
    with pytest.raises(CorruptObjectError, match="unsupported format version"):
        codec.decode(buf, LAYOUT)
    buf[4] = 2
    with pytest.raises(CorruptObjectError, match="unknown checksum algorithm 9"):
        codec.decode(buf, LAYOUT)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_block_codec_writes_what_encode_writes_and_reads_it_back(dtype: str) -> None:
    layout = small_layout(cache_dtype=dtype)
    bc = codec.block_codec(layout)
    big = mla_block(layout, 0, 3 * layout.block_size, seed=1).rows  # a staging buffer of 3 blocks
    for i in range(3):
        rows = big[:, i * 16 : (i + 1) * 16]  # a strided view, as the engine's export gives
        region = bytearray(bc.total_len + 10)
        n = bc.encode_into(memoryview(region)[5:], codec._as_numpy(rows), 16 * i)
        assert n == bc.total_len == codec.encoded_size(mla_block(layout, 0, 16))
        general = codec.encode(codec.MLABlock(rows.contiguous(), 16 * i, 16), layout)
        assert bytes(region[5 : 5 + n]) == bytes(general)
        dst = torch.full((3, *rows.shape), 7, dtype=torch.uint8).view(rows.dtype) if rows.dtype.itemsize == 1 else \
            torch.zeros((3, *rows.shape), dtype=rows.dtype)
        assert bc.decode_into(memoryview(region)[5 : 5 + n], codec._as_numpy(dst[1])) == 16 * i
        assert bit_equal(dst[1], rows)


def test_block_codec_declines_what_is_not_a_template_block() -> None:
    """Tails, DCP shards, KDA checkpoints, other layouts and other checksums go to ``decode``."""
    bc = codec.block_codec(LAYOUT)
    dst = np.zeros(bc.shape, dtype=bc.np_dtype)
    other = checksum.CRC32 if bc.algo == checksum.CRC32C else checksum.CRC32C
    with _with_algo(other):
        other_algo = codec.encode(mla_block(LAYOUT, 0, 16), LAYOUT)
    shard = split_dcp(mla_block(LAYOUT, 0, 16), 2)[1]
    for obj in (codec.encode(mla_block(LAYOUT, 16, 9), LAYOUT),  # a tail
                codec.encode(shard, LAYOUT),  # a DCP shard
                codec.encode(kda_shard(LAYOUT, 32), LAYOUT),
                codec.encode(mla_block(small_layout(model_id="other"), 0, 16), small_layout(model_id="other")),
                other_algo):
        assert bc.decode_into(memoryview(bytes(obj)), dst) is None
    assert not dst.any()


def test_block_codec_rejects_damage_without_writing_the_destination() -> None:
    bc = codec.block_codec(LAYOUT)
    buf = bytearray(codec.encode(mla_block(LAYOUT, 32, 16, seed=3), LAYOUT))
    dst = np.zeros(bc.shape, dtype=bc.np_dtype)
    for pos in (codec.HEADER_BYTES + 5, len(buf) - 1):  # payload, trailer
        bad = bytearray(buf)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptObjectError, match="checksum"):
            bc.decode_into(memoryview(bad), dst)
    assert not dst.any()
    bad = bytearray(buf)
    bad[40] ^= 1  # the start field: no longer block-aligned, so not a template block
    assert bc.decode_into(memoryview(bad), dst) is None
    with pytest.raises(CorruptObjectError):
        codec.decode(bad, LAYOUT)
