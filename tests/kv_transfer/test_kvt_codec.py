from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvt_util import bit_equal, kda_shard, mla_block, small_layout

from kv_transfer import codec
from kv_transfer.errors import CorruptObjectError, LayoutMismatchError

DTYPES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
          "float8_e4m3fnuz", "float8_e5m2fnuz"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("span", [16, 5])  # full block, tail
def test_mla_round_trip_bit_exact(dtype: str, span: int) -> None:
    layout = small_layout(cache_dtype=dtype)
    blk = mla_block(layout, 32, span, seed=3)
    buf = codec.encode(blk, layout)
    assert len(buf) == codec.encoded_size(blk)
    assert codec.read_header(buf).kind == (codec.ObjectKind.MLA if span == 16 else codec.ObjectKind.TAIL)
    for copy in (False, True):
        out = codec.decode(bytes(buf), layout, copy=copy)
        assert (out.start, out.span, out.dcp_size, out.dcp_rank) == (32, span, 1, 0)
        assert bit_equal(out.rows, blk.rows)


@pytest.mark.parametrize("conv_dtype,state_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                    ("float16", "float64")])
def test_kda_round_trip_bit_exact(conv_dtype: str, state_dtype: str) -> None:
    layout = small_layout(conv_dtype=conv_dtype, state_dtype=state_dtype)
    k = kda_shard(layout, 48, tp_rank=1, tp_size=2)
    out = codec.decode_kda(codec.encode(k, layout), layout)
    assert (out.position, out.tp_rank, out.tp_size) == (48, 1, 2)
    assert bit_equal(out.conv, k.conv) and bit_equal(out.recurrent, k.recurrent)


def test_nan_payloads_and_dcp_fields_survive() -> None:
    layout = small_layout(cache_dtype="float32")
    rows = torch.full((2, 4, 8), float("nan"))
    from kv_transfer.objects import MLABlock

    blk = MLABlock(rows, 16, 16, dcp_size=4, dcp_rank=2)
    out = codec.decode_mla(codec.encode(blk, layout), layout)
    assert (out.dcp_size, out.dcp_rank) == (4, 2) and bit_equal(out.rows, rows)


def test_zero_copy_decode_aliases_the_buffer() -> None:
    layout = small_layout(cache_dtype="float32")
    buf = codec.encode(mla_block(layout, 0, 16), layout)
    out = codec.decode_mla(buf, layout, copy=False)
    assert out.rows.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + codec.HEADER_BYTES
    owned = codec.decode_mla(buf, layout, copy=True)
    assert owned.rows.data_ptr() != out.rows.data_ptr()


def test_encode_into_a_region_and_parent_digest() -> None:
    layout = small_layout()
    blk = mla_block(layout, 16, 3)
    region = bytearray(codec.encoded_size(blk) + 100)
    n = codec.encode_into(blk, layout, memoryview(region)[50:], parent=b"p" * 16)
    assert n == codec.encoded_size(blk)
    assert codec.verify(memoryview(region)[50 : 50 + n]).parent == b"p" * 16


def test_layout_mismatch_is_detected() -> None:
    layout = small_layout()
    buf = codec.encode(mla_block(layout, 0, 16), layout)
    with pytest.raises(LayoutMismatchError):
        codec.decode(buf, small_layout(latent_dim=16))
    with pytest.raises(LayoutMismatchError):
        codec.decode(buf, small_layout(cache_dtype="float16"))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_or_truncation_is_detected(data) -> None:
    layout = small_layout()
    obj = data.draw(st.sampled_from([mla_block(layout, 0, 16), mla_block(layout, 16, 7),
                                     kda_shard(layout, 23, 1, 2)]))
    buf = bytearray(codec.encode(obj, layout))
    if data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= data.draw(st.integers(1, 255))
    else:
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    with pytest.raises(CorruptObjectError):
        codec.decode(bytes(buf), layout)


@pytest.mark.parametrize("damage", ["magic", "version", "extra"])
def test_header_damage_kinds(damage: str) -> None:
    layout = small_layout()
    buf = bytearray(codec.encode(mla_block(layout, 0, 16), layout))
    if damage == "magic":
        buf[0:4] = b"XXXX"
    elif damage == "version":
        buf[4] = 99
    else:
        buf += b"\0"
    with pytest.raises(CorruptObjectError):
        codec.decode(buf, layout)
