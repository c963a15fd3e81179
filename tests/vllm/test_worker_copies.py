"""Worker side: gather/scatter over caches that vLLM itself allocates (``allocate_kv_cache``).

Pages are laid out exactly as vLLM 0.33 lays them out: MLA [blocks, 1, rows, C]
views, KDA raw byte pages padded to the MLA page size and split into conv /
recurrent views by vLLM's own ``MambaBase.bind_kv_cache``. A K3-like geometry:
576-wide latent rows, 8 KDA heads split over TP ranks.
"""

from __future__ import annotations

import k3_harness as H
import pytest
import torch

pytestmark = pytest.mark.vllm

LATENT, HEADS, HK, BS = 576, 8, 16, 16
MLA_LAYERS = ("model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn")
KDA_LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn")


class Rank:
    """One worker's caches (vLLM-allocated) and its WorkerSide."""

    def __init__(self, *, tp=1, tp_rank=0, dcp=1, layout="LBNHC", conv_layout="SD", mla_dtype=torch.bfloat16,
                 tiers=None, num_blocks=24):
        from vllm.model_executor.layers.mamba.abstract import MambaBase
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import (
            get_kv_cache_config_from_groups,
            get_kv_cache_groups,
        )
        from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec
        from vllm.v1.worker.utils import allocate_kv_cache

        from kv_transfer.vllm.geometry import CacheGeometry
        from kv_transfer.vllm.stores import StoreSet
        from kv_transfer.vllm.worker_side import WorkerSide

        vc = H.vllm_config(block=BS)
        vc.cache_config.kv_cache_layout = None
        record_kv_cache_layout(vc.cache_config, layout)
        rows = BS // dcp
        h = HEADS // tp
        conv = (3, 3 * h * HK) if conv_layout == "SD" else (3 * h * HK, 3)
        mla = MLAAttentionSpec(block_size=rows, num_kv_heads=1, head_size=LATENT, dtype=mla_dtype,
                               cache_dtype_str="auto")
        kda = MambaSpec(block_size=BS, shapes=(conv, (h, HK, HK)), dtypes=(torch.bfloat16, torch.float32),
                        page_size_padded=mla.page_size_bytes, mamba_cache_mode="align")
        specs = {n: mla for n in MLA_LAYERS} | {n: kda for n in KDA_LAYERS}
        self.kcc = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs),
                                                   num_blocks * mla.page_size_bytes * 2)
        self.caches = allocate_kv_cache(self.kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
        self.geo = CacheGeometry.from_vllm(self.kcc, "k3-like", tp_size=tp, dcp_size=dcp, conv_layout=conv_layout)
        from kv_transfer.tiers.memory import DictByteStore

        self.tiers = tiers if tiers is not None else [DictByteStore(name="host")]
        self.stores = StoreSet(self.tiers, self.geo.layout, tp, dcp)
        self.worker = WorkerSide(self.geo, self.stores, tp_rank=tp_rank, dcp_rank=tp_rank % dcp, async_saves=False)
        self.worker.register(self.caches)
        self.kda = {}
        for n in KDA_LAYERS:
            layer = H._StateLayer(kda.shapes, kda.dtypes)
            MambaBase.bind_kv_cache(layer, self.caches[n])
            self.kda[n] = layer.kv_cache
        self.mla = {n: self.caches[n][:, 0] for n in MLA_LAYERS}
        self.groups = {g.group_id: g for g in self.geo.groups}

    def group_of(self, layer: str) -> int:
        return next(g.group_id for g in self.geo.groups if layer in g.layer_names)


def _random_fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    raw.copy_(torch.randint(-(2 ** 15), 2 ** 15, raw.shape, generator=g).to(raw.dtype))


def _jobs(tokens, position, src_pages, dst_pages, src_kda, dst_kda, rank):
    from kv_transfer.vllm.jobs import LoadJob, SaveJob

    mla_src = {rank.group_of(n): src_pages for n in MLA_LAYERS}
    mla_dst = {rank.group_of(n): dst_pages for n in MLA_LAYERS}
    kda_src = {rank.group_of(n): src_kda for n in KDA_LAYERS}
    kda_dst = {rank.group_of(n): dst_kda for n in KDA_LAYERS}
    save = SaveJob(1, "r", tokens[:position], "", position, 0, mla_src, kda_src, finish=True)
    load = LoadJob("r", tokens[:position], "", position, 0, mla_dst, kda_dst)
    return save, load


def _save(rank, job):
    rank.worker.begin_saves([job])
    for n in MLA_LAYERS:  # layer-wise, as vLLM calls save_kv_layer after each MLA layer
        rank.worker.save_layer(n)
    rank.worker.finish_saves()
    sending, _, _ = rank.worker.results()
    assert sending == {"r"}


@pytest.mark.parametrize("layout, conv_layout, mla_dtype, tp", [
    ("LBNHC", "SD", torch.bfloat16, 1),
    ("BLNHC", "SD", torch.bfloat16, 1),          # block-outermost: layers interleaved inside a block
    ("LBNHC", "DS", torch.bfloat16, 1),          # VLLM_SSM_CONV_STATE_LAYOUT=DS
    ("LBNHC", "SD", torch.float8_e4m3fn, 2),     # FP8 KV cache (half the page: 4 heads per rank fit)
])
def test_round_trip_is_bit_exact(layout, conv_layout, mla_dtype, tp):
    src = Rank(layout=layout, conv_layout=conv_layout, mla_dtype=mla_dtype, tp=tp)
    dst = Rank(layout=layout, conv_layout=conv_layout, mla_dtype=mla_dtype, tp=tp, tiers=src.tiers)
    for i, t in enumerate(src.caches.values()):
        _random_fill(t, i)  # every byte of every page, padding included
    sentinel = [t.clone() for t in dst.caches.values()]
    tokens = H.prompt(60, seed=1)
    position = 2 * BS + 5  # two full blocks and a 5-row tail
    save, load = _jobs(tokens, position, [7, 3, 11], [2, 9, 5], 13, 4, src)
    _save(src, save)
    dst.worker.start_loads([load])
    _, recving, failed = dst.worker.results()
    assert recving == {"r"} and not failed
    for n in MLA_LAYERS:
        s, d = src.mla[n], dst.mla[n]
        assert H.bits_equal(s[7], d[2]) and H.bits_equal(s[3], d[9])
        assert H.bits_equal(s[11][:5], d[5][:5])  # tail rows
        assert H.bits_equal(d[5][5:], sentinel[list(dst.caches).index(n)][5][0, 5:])  # rows past the tail untouched
    for n in KDA_LAYERS:
        (sc, ss), (dc, ds) = src.kda[n], dst.kda[n]
        assert H.bits_equal(sc[13], dc[4]) and H.bits_equal(ss[13], ds[4])
    # bytes past the state in the padded KDA page are not the connector's: never written
    kda_spec = src.kcc.kv_cache_groups[src.group_of(KDA_LAYERS[0])].kv_cache_spec
    real = kda_spec.real_page_size_bytes
    raw = dst.caches[KDA_LAYERS[0]].view(dst.caches[KDA_LAYERS[0]].shape[0], -1)
    before = sentinel[list(dst.caches).index(KDA_LAYERS[0])].view(raw.shape[0], -1)
    assert torch.equal(raw[4, real:], before[4, real:]) and kda_spec.page_size_padded > real
    # untouched blocks stay untouched
    assert torch.equal(dst.caches[MLA_LAYERS[0]][0], sentinel[list(dst.caches).index(MLA_LAYERS[0])][0])


def test_tp8_stores_the_latent_once_and_every_kda_shard():
    from kv_transfer.tiers.memory import DictByteStore

    tiers = [DictByteStore(name="host")]
    src = [Rank(tp=8, tp_rank=r, tiers=tiers) for r in range(8)]
    dst = [Rank(tp=8, tp_rank=r, tiers=tiers) for r in range(8)]
    for i, t in enumerate(src[0].caches.values()):
        _random_fill(t, i)
    pages = [1, 2, 3, 4]
    for r in src[1:]:  # the latent is replicated over TP; KDA state is each rank's head shard
        for n in MLA_LAYERS:  # (groups alias one backing buffer: fill only the blocks each group owns)
            r.mla[n][pages] = src[0].mla[n][pages]
        for k, n in enumerate(KDA_LAYERS):
            for j, v in enumerate(r.kda[n]):
                _random_fill(v[5], 1000 * r.worker.tp_rank + 10 * k + j)
    tokens = H.prompt(80, seed=2)
    position = 3 * BS + 9
    for r in src:
        save, _ = _jobs(tokens, position, [1, 2, 3, 4], [], 5, 0, r)
        _save(r, save)
    keys = tiers[0].keys()
    assert sum(k.startswith("mla:") for k in keys) == 3  # three full blocks, stored once
    assert sum(k.startswith("tail:") for k in keys) == 1
    assert sorted(k.rsplit(":", 1)[1] for k in keys if k.startswith("kda:")) == [f"tp{r}of8" for r in range(8)]
    gathered = [r.worker.counters["objects_saved"] for r in src]
    assert gathered[0] == 5 and gathered[1:] == [1] * 7  # rank 0: blocks + tail + its shard; others: their shard
    assert all(r.worker.counters["objects_skipped"] == 1 for r in src[1:])  # the tail, already there
    for s, d in zip(src, dst, strict=True):
        _, load = _jobs(tokens, position, [], [20, 21, 22, 23], 0, 19, d)
        d.worker.start_loads([load])
        assert d.worker.results()[1] == {"r"}
        for n in MLA_LAYERS:
            assert all(H.bits_equal(s.mla[n][a], d.mla[n][b]) for a, b in ((1, 20), (2, 21), (3, 22)))
            assert H.bits_equal(s.mla[n][4][:9], d.mla[n][23][:9])
        for n in KDA_LAYERS:
            assert H.bits_equal(s.kda[n][0][5], d.kda[n][0][19]) and H.bits_equal(s.kda[n][1][5], d.kda[n][1][19])
    # a point is resumable only with every TP shard of its checkpoint
    store = src[0].stores.own
    hasher = src[0].worker.hasher("")
    assert store.resumable_length(tokens, hasher, position).position == position
    tiers[0].delete(next(k for k in keys if k.endswith(":tp5of8")))
    assert store.resumable_length(tokens, hasher, position).position == 0


def _logical_rows(n_pos: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(n_pos, LATENT, generator=g).to(torch.bfloat16) for n in MLA_LAYERS}


def _write_dcp(rank: Rank, rows: dict, pages: list[int], dcp: int, dcp_rank: int) -> None:
    """Lay logical rows out as vLLM's DCP does: position t on rank t % dcp, row (t % S) // dcp."""
    for n, r in rows.items():
        for t in range(r.shape[0]):
            if t % dcp == dcp_rank:
                rank.mla[n][pages[t // BS], (t % BS) // dcp] = r[t]


@pytest.mark.parametrize("src_dcp, dst_dcp", [(2, 1), (1, 2), (2, 4)])
def test_dcp_reshard(src_dcp, dst_dcp):
    from kv_transfer.tiers.memory import DictByteStore

    tp = 4
    tiers = [DictByteStore(name="host")]
    tokens = H.prompt(80, seed=3)
    position = 2 * BS + 7
    rows = _logical_rows(position, 5)
    src = [Rank(tp=tp, tp_rank=r, dcp=src_dcp, tiers=tiers) for r in range(tp)]
    for r in src:
        _write_dcp(r, rows, [6, 7, 8], src_dcp, r.worker.dcp_rank)
        for k, n in enumerate(KDA_LAYERS):
            for j, v in enumerate(r.kda[n]):
                _random_fill(v[2], 100 * r.worker.tp_rank + 10 * k + j)
        save, _ = _jobs(tokens, position, [6, 7, 8], [], 2, 0, r)
        _save(r, save)
    shards = {k.rsplit(":", 1)[-1] for k in tiers[0].keys() if k.startswith("mla:")}
    assert shards == ({f"dcp{i}of{src_dcp}" for i in range(src_dcp)} if src_dcp > 1 else {k.split(":")[1] for k in tiers[0].keys() if k.startswith("mla:")})
    for r in range(tp):
        d = Rank(tp=tp, tp_rank=r, dcp=dst_dcp, tiers=tiers)
        from kv_transfer.vllm.jobs import LoadJob

        load = LoadJob("r", tokens[:position], "", position, 0, {d.group_of(MLA_LAYERS[0]): [10, 11, 12]},
                       {d.group_of(n): 3 for n in KDA_LAYERS}, source_dcp_size=src_dcp)
        d.worker.start_loads([load])
        assert d.worker.results()[1:] == ({"r"}, set())
        for n, r_ in rows.items():
            for t in range(position):
                if t % dst_dcp == d.worker.dcp_rank:
                    assert H.bits_equal(d.mla[n][[10, 11, 12][t // BS], (t % BS) // dst_dcp], r_[t]), (n, t)
        for n in KDA_LAYERS:  # KDA state is replicated over DCP, sharded over TP
            assert H.bits_equal(d.kda[n][1][3], src[r].kda[n][1][2])


def test_corrupt_object_fails_the_load_and_touches_no_block():
    from kv_transfer.codec import HEADER_BYTES

    src = Rank()
    dst = Rank(tiers=src.tiers)
    for i, t in enumerate(src.caches.values()):
        _random_fill(t, i)
    before = {n: t.clone() for n, t in dst.caches.items()}
    tokens = H.prompt(60, seed=4)
    position = 2 * BS + 3
    save, load = _jobs(tokens, position, [1, 2, 3], [4, 5, 6], 7, 8, src)
    _save(src, save)
    tier = src.tiers[0]
    key = sorted(k for k in tier.keys() if k.startswith("kda:"))[0]
    bad = bytearray(tier.get_bytes(key))
    bad[HEADER_BYTES + 3] ^= 0x40
    tier.delete(key)
    tier.put_bytes(key, bytes(bad))
    dst.worker.start_loads([load])
    _, recving, failed = dst.worker.results()
    assert recving == {"r"} and failed == {"r"}  # reported finished *and* failed: vLLM recomputes
    assert dst.worker.error_blocks() == {4, 5, 6, 8}
    assert all(torch.equal(t, before[n]) for n, t in dst.caches.items())  # nothing scattered
    assert key not in tier.keys() and dst.stores.own.stats()["num_corrupt_pieces"] >= 0
