"""Drive vLLM 0.33's real ``Scheduler`` on CPU with the K3 state connector.

What is real: vLLM's config classes, ``Scheduler`` (hybrid KV cache manager
with an MLA group and KDA groups in mamba "align" mode), the connector factory
loading ``kv_transfer.vllm_connector`` by module path, vLLM's own cache
allocation (``allocate_kv_cache``) and KDA page split (``MambaBase.bind_kv_cache``).

What stands in for the GPU (the system boundary that cannot run here): a
deterministic *fake forward* that, like the model, reads its recurrent state
from the block vLLM's block table names, writes the new state and the MLA rows
where vLLM's tables say, and samples a token from the state and the MLA rows of
every earlier position. A wrong block, a wrong byte or a stale state changes
the sampled tokens; the state after p tokens does not depend on how the prompt
was chunked, so a resumed run must reproduce an uninterrupted one exactly:

    rec(p)  = rec(c) * 3^(p-c) + horner_3(tokens[c:p])   (mod 1009, fp32-exact)
    conv(p) = f(tokens[p-3:p])                            (bf16-exact)
    mla(t)  = g(token_t, t, layer)                        (bf16-exact)
    sample  = (sum rec + sum conv + sum mla rows < p) mod 900 + 3
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
import uuid
from pathlib import Path

import torch

TINY = Path(__file__).parent / "tiny_kimi_linear"
MODEL_ID = "tiny-k3|bfloat16"  # what the backend derives: served name | dtype
MOD = 1009


def vllm_config(*, role: str = "kv_both", tier: str = "t0", block: int = 128, pmu: int | None = None,
                extra: dict | None = None, engine_id: str = "engine", max_len: int = 4096, batched: int = 1024):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.attention.backends.utils import record_kv_cache_layout

    mc = ModelConfig(model=str(TINY), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_len)
    ktc = KVTransferConfig(
        kv_connector="K3StateConnector", kv_connector_module_path="kv_transfer.vllm_connector", kv_role=role,
        kv_load_failure_policy="recompute", engine_id=engine_id,
        kv_connector_extra_config={"local_tier": tier, "model_id": MODEL_ID, "async_saves": False,
                                   "handle_wait_s": 2.0, **(extra or {})})
    vc = VllmConfig(model_config=mc,
                    cache_config=CacheConfig(block_size=block, enable_prefix_caching=True, prefix_match_unit=pmu),
                    scheduler_config=SchedulerConfig(max_model_len=max_len, is_encoder_decoder=False,
                                                     enable_chunked_prefill=True, max_num_batched_tokens=batched,
                                                     max_num_seqs=8),
                    kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # the CPU platform turns HMA off
    vc.cache_config.mamba_block_size = block
    record_kv_cache_layout(vc.cache_config, "LBNHC")
    return vc


def kv_cache_config(vc, num_blocks: int = 200, mla_only: bool = False):
    """vLLM's own grouping and tensor plan for the tiny model's layers (1 MLA + 3 KDA)."""
    from vllm.models.kimi_k3 import KimiLinearForCausalLM
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import (
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    block = vc.cache_config.block_size
    mla = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=vc.model_config.get_head_size(),
                           dtype=torch.bfloat16, cache_dtype_str="auto")
    specs = {"model.layers.3.self_attn.attn": mla}
    if not mla_only:
        mamba = MambaSpec(block_size=block, shapes=KimiLinearForCausalLM.get_mamba_state_shape_from_config(vc),
                          dtypes=KimiLinearForCausalLM.get_mamba_state_dtype_from_config(vc),
                          page_size_padded=mla.page_size_bytes, mamba_cache_mode="align")
        specs.update({f"model.layers.{i}.self_attn": mamba for i in range(3)})
    kcc = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs), num_blocks * mla.page_size_bytes)
    sbs, hbs = resolve_kv_cache_block_sizes(kcc, vc)
    kcc.hash_block_size = hbs
    kcc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kcc, vc, sbs, hbs)
    vc.cache_config.hash_block_size = hbs
    vc.cache_config.cache_hit_alignment_tokens = kcc.cache_hit_alignment_tokens
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    return kcc, sbs, hbs


class _StateLayer:
    """Stands in for a KDA layer so vLLM's ``MambaBase.bind_kv_cache`` splits the page for us."""

    def __init__(self, shapes, dtypes):
        self._shapes, self._dtypes = shapes, dtypes
        self.kv_cache = None

    def get_state_shape(self):
        return self._shapes

    def get_state_dtype(self):
        return self._dtypes


class _CapturePublisher:
    """Stands in for vLLM's ZMQ KV-event publisher: keeps every published event."""

    def __init__(self, sink: list):
        self.sink = sink

    def publish(self, batch) -> None:
        self.sink.extend(batch.events)

    def shutdown(self) -> None:
        return None

    def get_publisher_config(self):
        return None


@dataclasses.dataclass
class Finished:
    tokens: list[int]  # output tokens
    reason: str  # vLLM finish reason
    kv_transfer_params: dict | None  # what the connector returned


class Engine:
    """One vLLM scheduler + one worker connector (TP 1) + a fake forward over real cache views."""

    def __init__(self, vc, num_blocks: int = 200, mla_only: bool = False):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.model_executor.layers.mamba.abstract import MambaBase
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kv_transfer.vllm_connector import K3StateConnector

        self.vc = vc
        self.kcc, self.sbs, hbs = kv_cache_config(vc, num_blocks, mla_only)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=self.kcc,
                               structured_output_manager=StructuredOutputManager(vc), block_size=self.sbs,
                               hash_block_size=hbs, log_stats=True)
        self.connector = self.sched.connector
        self.published: list = []  # KV events vLLM publishes (its ZMQ publisher is the boundary)
        self.sched.kv_event_publisher = _CapturePublisher(self.published)
        assert isinstance(self.connector, K3StateConnector), type(self.connector)
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(hbs, sha256)
        wvc = copy.copy(vc)
        ktc = vc.kv_transfer_config
        wvc.kv_transfer_config = dataclasses.replace(
            ktc, kv_connector_extra_config={**ktc.kv_connector_extra_config, "tp_rank": 0})
        self.worker = K3StateConnector(wvc, KVConnectorRole.WORKER, self.kcc)
        self.caches = allocate_kv_cache(self.kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout())
        self.worker.register_kv_caches(self.caches)
        self.geo = self.worker.geometry
        self.groups = [list(g.layer_names) for g in self.kcc.kv_cache_groups]
        self.mla = {}  # layer -> (group, [blocks, 1, rows, C] view)
        self.kda = {}  # layer -> (group, conv view, ssm view)
        for gid, g in enumerate(self.kcc.kv_cache_groups):
            for name in g.layer_names:
                if hasattr(g.kv_cache_spec, "shapes"):
                    layer = _StateLayer(g.kv_cache_spec.shapes, g.kv_cache_spec.dtypes)
                    MambaBase.bind_kv_cache(layer, self.caches[name])
                    self.kda[name] = (gid, *layer.kv_cache)
                else:
                    self.mla[name] = (gid, self.caches[name])
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Finished] = {}
        self.step_log: list[dict] = []

    # ---- requests -------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_tokens: int = 3, kv_params: dict | None = None,
            cache_salt: str | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if kv_params is not None:
            sp.extra_args = {"kv_transfer_params": dict(kv_params)}
        self.sched.add_request(Request(rid, list(prompt), sp, None, block_hasher=self.block_hasher,
                                       cache_salt=cache_salt))
        self.tokens[rid] = list(prompt)
        self.outputs[rid] = []

    def run(self, max_steps: int = 60, timeout_s: float = 30.0) -> None:
        """Step until no request, save or pin is left; idle steps (saves in flight) back off."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while self.sched.has_unfinished_requests() or self.connector.has_pending_push_work() \
                or self.worker._worker.has_pending_saves():
            out = self.step()
            steps += out.total_num_scheduled_tokens > 0
            if not out.total_num_scheduled_tokens:
                time.sleep(0.005)
            if steps > max_steps or time.monotonic() > deadline:
                raise AssertionError(f"engine did not finish: requests {list(self.sched.requests)}, "
                                     f"pending push {self.connector.has_pending_push_work()}, "
                                     f"saves {self.worker._worker.has_pending_saves()}")

    # ---- one step: vLLM's schedule -> worker hooks -> update_from_output --------------
    def step(self):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        for r in out.scheduled_new_reqs:
            self.tables[r.req_id] = [list(b) for b in r.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is None:
                continue
            if rid in cached.resumed_req_ids:
                self.tables[rid] = [list(b) for b in new_ids]
            else:
                for table, ids in zip(self.tables[rid], new_ids, strict=True):
                    table.extend(ids)
        for b in out.new_block_ids_to_zero or []:
            for t in self.caches.values():
                t[b].zero_()
        for cp in out.kv_cache_block_copies or []:
            for t in self.caches.values():
                t[cp.dst_block_id].copy_(t[cp.src_block_id])
        w = self.worker
        if out.kv_connector_metadata is not None:
            w.bind_connector_metadata(out.kv_connector_metadata)
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            sampled[rid] = self._forward(rid, computed[rid], n)
        if out.kv_connector_metadata is not None:
            w.start_load_kv(None)  # async loads start after the forward (vLLM does the same)
            w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[sampled[r]] if sampled[r] is not None else [] for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending or None, finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving, invalid_block_ids=invalid, kv_connector_worker_meta=wmeta))
        self.step_log.append({"scheduled": dict(out.num_scheduled_tokens), "failed": set(res.failed_recving),
                              "invalid": set(invalid), "sending": set(res.finished_sending),
                              "recving": set(res.finished_recving),
                              "loads": list(getattr(out.kv_connector_metadata, "loads", [])),
                              "saves": list(getattr(out.kv_connector_metadata, "saves", []))})
        eco = self.sched.update_from_output(out, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = Finished(list(self.outputs[o.request_id]), str(o.finish_reason),
                                                           o.kv_transfer_params)
        for rid, tok in sampled.items():
            if tok is not None and rid in self.tokens:
                self.tokens[rid].append(tok)
        return out

    # ---- the fake forward ------------------------------------------------------------
    def _kda_index(self, p: int) -> int:
        return math.ceil(p / self.geo.mamba_block) - 1

    def _forward(self, rid: str, c: int, n: int) -> int | None:
        toks = self.tokens[rid]
        p = c + n
        table = self.tables[rid]
        S = self.sbs
        a = pow(3, n, MOD)
        b = 0
        for t in toks[c:p]:
            b = (b * 3 + t) % MOD
        state_sum = 0.0
        for k, (_name, (gid, conv_v, ssm_v)) in enumerate(sorted(self.kda.items())):
            if c == 0:
                rec0 = (torch.arange(ssm_v[0].numel(), dtype=torch.float32).view_as(ssm_v[0]) * (k + 1)) % MOD
            else:
                rec0 = ssm_v[table[gid][self._kda_index(c)]].clone()
            rec = (rec0 * a + b) % MOD
            last = [toks[i] if i >= 0 else 0 for i in range(p - conv_v.shape[1], p)]
            chans = torch.arange(conv_v.shape[2], dtype=torch.float32)
            conv = torch.stack([(t + 7 * k + chans) % 97 for t in last]).to(conv_v.dtype)
            blk = table[gid][self._kda_index(p)]
            ssm_v[blk] = rec
            conv_v[blk] = conv
            state_sum += float(rec.sum()) + float(conv.float().sum())
        pos = torch.arange(c, p)
        tok = torch.tensor(toks[c:p], dtype=torch.float32)
        for l_idx, (name, (gid, view)) in enumerate(sorted(self.mla.items())):
            dim = view.shape[-1]
            rows = (tok[:, None] * 131 + pos[:, None] * 7 + l_idx * 17 + torch.arange(dim)) % 251 - 125
            pages = torch.tensor([table[gid][t // S] for t in range(c, p)])
            view[pages, 0, pos % S] = rows.to(view.dtype)
            self.worker.save_kv_layer(name, view, None)
        if p < len(toks):
            return None  # a partial prefill chunk samples nothing
        mla_sum = 0.0
        allpos = torch.arange(0, p)
        for _name, (gid, view) in sorted(self.mla.items()):
            pages = torch.tensor([table[gid][t // S] for t in range(p)])
            mla_sum += float(view[pages, 0, allpos % S].float().sum())
        return int(state_sum + mla_sum) % 900 + 3

    # ---- inspection ------------------------------------------------------------------
    def kda_state(self, rid: str, position: int) -> list[torch.Tensor]:
        """(conv, ssm) bytes of every KDA layer's state block at ``position`` in ``rid``'s table."""
        out = []
        for _name, (gid, conv_v, ssm_v) in sorted(self.kda.items()):
            blk = self.tables[rid][gid][self._kda_index(position)]
            out += [conv_v[blk].clone(), ssm_v[blk].clone()]
        return out

    def mla_rows(self, rid: str, start: int, end: int) -> list[torch.Tensor]:
        out = []
        for _name, (gid, view) in sorted(self.mla.items()):
            pages = torch.tensor([self.tables[rid][gid][t // self.sbs] for t in range(start, end)])
            out.append(view[pages, 0, torch.arange(start, end) % self.sbs].clone())
        return out

    def num_free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def make_tier(name: str | None = None, data: dict | None = None):
    """A fresh in-process host tier registered for connectors (optionally pre-filled)."""
    from kv_transfer.tiers.memory import DictByteStore
    from kv_transfer.vllm.stores import register_local_tier

    name = name or f"tier-{uuid.uuid4().hex[:8]}"
    tier = DictByteStore(name="host")
    for key, value in (data or {}).items():
        tier.put_bytes(key, value)
    register_local_tier(name, tier)
    return name, tier


class GatedTier:
    """A host tier whose writes wait for a gate: saves that take as long as the test wants."""

    def __init__(self):
        from kv_transfer.tiers.memory import DictByteStore

        self.inner = DictByteStore(name="host")
        self.name = "host"
        self.gate = threading.Event()

    def put_bytes(self, key, data):
        assert self.gate.wait(30), "gate never opened"
        return self.inner.put_bytes(key, data)

    def get_bytes(self, key):
        return self.inner.get_bytes(key)

    def contains(self, keys):
        return self.inner.contains(keys)

    def delete(self, key):
        return self.inner.delete(key)


def baseline(prompt: list[int], max_tokens: int, mla_only: bool = False, **cfg) -> list[int]:
    """Outputs of an engine with an empty store (everything computed)."""
    name, _ = make_tier()
    e = Engine(vllm_config(role="kv_consumer", tier=name, engine_id="base", **cfg), mla_only=mla_only)
    e.add("x", prompt, max_tokens=max_tokens)
    e.run()
    return e.outputs["x"]


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
