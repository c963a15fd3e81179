"""Batched decode (``DecodeBatch``) equals the per-sequence path: logits and state, fp64."""

from __future__ import annotations

import torch

from disagg.engine.reference.cache_view import DenseSequenceCache, SeqInput
from disagg.engine.reference.layers import TokenSpan
from disagg.engine.reference.paged_cache import (
    DecodeBatch,
    PagedSeqCache,
    PagedStateCache,
    size_cache,
)

BS = 64


def _paged(model, lengths):
    layout = model.state_layout("t", BS, torch.float64)
    cache = PagedStateCache(layout, size_cache(layout, 32 << 20, max_num_seqs=len(lengths)))
    views = []
    for n in lengths:
        table = cache.blocks.allocate(n // BS + 2)  # room for the decode steps
        views.append(PagedSeqCache(cache, table, cache.allocate_slot(), 0))
    return cache, views


def test_batched_decode_equals_per_sequence_decode(tiny_fp64, helpers):
    model = tiny_fp64
    lengths = (70, 128, 5)  # 128: the first decode token opens a new block
    prompts = [helpers.token_ids(n, seed=20 + i) for i, n in enumerate(lengths)]
    cache, views = _paged(model, lengths)
    dense = [DenseSequenceCache.empty(model.config, torch.float64) for _ in lengths]
    nxt = []
    for p, view, d in zip(prompts, views, dense, strict=True):
        model([SeqInput(p, 0, view)])
        view.start_pos = p.numel()
        nxt.append(model([SeqInput(p, 0, d)])[0].argmax(-1))
    for _ in range(5):
        seqs = [SeqInput(t, v.start_pos, v) for t, v in zip(nxt, views, strict=True)]
        batched = model(seqs)  # one forward: the DecodeBatch path
        alone = [model([SeqInput(t, d.num_tokens, d)])[0] for t, d in zip(nxt, dense, strict=True)]
        for b, a in zip(batched, alone, strict=True):
            assert helpers.rel_err(b, a) < 1e-10
            assert torch.equal(b.argmax(-1), a.argmax(-1))
        for v in views:
            v.start_pos += 1
        nxt = [a.argmax(-1) for a in alone]
    for v, d in zip(views, dense, strict=True):
        for m in range(len(d.mla)):
            torch.testing.assert_close(cache.read_rows(m, v.block_table, 0, v.start_pos), d.mla[m], rtol=1e-12, atol=1e-12)
        for k in range(len(d.kda_rec)):
            torch.testing.assert_close(cache.rec[k][v.slot], d.kda_rec[k], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(cache.conv[k][v.slot], d.kda_conv[k], rtol=1e-12, atol=1e-12)


def test_split_batches_only_paged_single_token_spans(tiny_fp64):
    _, views = _paged(tiny_fp64, (64, 64))
    views[0].start_pos, views[1].start_pos = 64, 10
    dense = DenseSequenceCache.empty(tiny_fp64.config, torch.float64)
    spans = [TokenSpan(0, 1, 64, views[0]), TokenSpan(1, 3, 10, views[1]), TokenSpan(4, 1, 0, dense)]
    batch, rest = DecodeBatch.split(spans)
    assert batch is not None and batch.size == 1
    assert [sp.offset for sp in rest] == [1, 4]
    assert batch.write_at.tolist() == [views[0].block_table[1] * BS]  # position 64: block 1, row 0
    assert batch.masked.shape == (1, 2 * BS) and not batch.masked[0, :65].any() and batch.masked[0, 65:].all()
