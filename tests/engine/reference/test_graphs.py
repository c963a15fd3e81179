"""Piecewise CUDA graphs of the token-wise work (model NOTE 6, ``graphs.py``).

The replay tests run twice: with real CUDA graphs (marked ``gpu``), and on a
CPU with the runner's stand-in graphs (graphs NOTE 5), which bind their inputs
and outputs at "capture" as real graphs do, so the runner's buffers, padding
and data flow are checked without a GPU. On a CPU the graph flag alone is a
no-op, and that is checked here too.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.graphs import BUCKETS, StepGraphs, bucket_for
from disagg.engine.reference.model import MAX_GRAPH_TOKENS, K3ForCausalLM

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RUNNERS = pytest.mark.parametrize("where", [pytest.param("cuda", marks=[pytest.mark.gpu, cuda]), "stand-in"])


def _graph_model(where: str) -> K3ForCausalLM:
    """A tiny model with a graph runner: real CUDA graphs, or stand-ins on the CPU."""
    if where == "cuda":
        return K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=torch.bfloat16, device="cuda")
    model = K3ForCausalLM.random_init(load_preset("tiny"), seed=0)
    model._graphs = StepGraphs(model, capture=False)
    return model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, graphs: bool, **kw) -> ReferenceEngine:
    opts = dict(block_size=64, max_num_batched_tokens=1024, cache_budget_bytes=256 << 20, max_num_seqs=8,
                capture_logits=True, cuda_graphs=graphs, checkpoint_interval=64)
    opts.update(kw)
    return ReferenceEngine(model, "graphs-test", EngineOptions(**opts))


def _run_mix(engine: ReferenceEngine) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Prefills of several lengths in one step (above the graph limit), then batched decodes; a
    follow-up turn that extends a resident session at its turn end (a prefill over cached
    history, unaligned); a lone prompt (a one-sequence prefill from 0) and an edited follow-up
    that resumes it at a block boundary (a one-sequence prefill over history, aligned)."""
    def gen(rid: str, tokens: list[int], n: int, **kw) -> list[int]:
        return engine.generate(EngineRequest(rid, tokens, SamplingParams(max_tokens=n, ignore_eos=True), **kw))[0]

    reqs = {"a": _prompt(700, 1), "b": _prompt(130, 2), "c": _prompt(5, 3)}
    for rid, p in reqs.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=12, ignore_eos=True)))
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    out["d"] = gen("d", reqs["b"] + out["b"] + _prompt(200, 4), 4)
    e = _prompt(300, 5)
    out["e"] = gen("e", e, 6, keep_state=True)  # kept: KDA checkpoints every block
    engine.release("e")
    out["f"] = gen("f", e[:280] + _prompt(90, 6), 6)  # shares 280 tokens: resumes at 256
    return out, {k: v.float().cpu() for k, v in engine.last_logits.items()}


def test_buckets_cover_every_graph_step():
    assert BUCKETS[-1] == MAX_GRAPH_TOKENS and list(BUCKETS) == sorted(set(BUCKETS))
    assert [bucket_for(n) for n in (1, 3, 24, 25, 257, 512)] == [1, 4, 24, 32, 320, 512]
    assert bucket_for(MAX_GRAPH_TOKENS + 1) is None


def test_graph_flag_is_eager_off_cuda(tiny_fp32):
    """Off CUDA the model has no graph runner and the flag changes nothing, bit for bit."""
    assert tiny_fp32.step_graphs() is None
    a, la = _run_mix(_engine(tiny_fp32, graphs=True))
    b, lb = _run_mix(_engine(tiny_fp32, graphs=False))
    assert a == b and all(torch.equal(la[k], lb[k]) for k in la)


@RUNNERS
def test_graph_replay_matches_eager_steps(where: str):
    """Prefill chunks, batched decodes and resumed follow-ups give the same greedy tokens with
    graphs as without, logits to bf16 rounding (fp32 on the CPU: padded batches may sum in
    another order); steps above the limit run eagerly."""
    model = _graph_model(where)
    runner = model.step_graphs() if where != "cuda" else None
    eager, le = _run_mix(_engine(model, graphs=False))
    assert getattr(model, "_graphs", None) is runner and (runner is None or runner.captures == 0)
    graphs, lg = _run_mix(_engine(model, graphs=True))
    runner = model.step_graphs()
    assert runner.failed is None and runner.captures >= 4  # 300/370-token prefills, 114, 44, decodes
    assert runner.decode_failed is None and runner.decode_captures >= 1  # the batched decodes, whole
    assert graphs == eager
    tol = dict(rtol=0.05, atol=0.1) if where == "cuda" else dict(rtol=1e-4, atol=1e-4)
    for k in le:
        torch.testing.assert_close(lg[k], le[k], **tol)


@RUNNERS
def test_two_engines_on_one_model_replay_in_turn(where: str):
    """Two engines stepping one model from two threads share its graphs without mixing their
    buffers: each gets the tokens it gets alone."""
    model = _graph_model(where)
    alone = {rid: _engine(model, graphs=True).generate(
        EngineRequest(rid, _prompt(40 + 30 * i, i), SamplingParams(max_tokens=24, ignore_eos=True)))[0]
        for i, rid in enumerate(("x", "y"))}
    got: dict[str, list[int]] = {}

    def worker(i: int, rid: str) -> None:
        eng = _engine(model, graphs=True)
        got[rid] = eng.generate(EngineRequest(rid, _prompt(40 + 30 * i, i),
                                              SamplingParams(max_tokens=24, ignore_eos=True)))[0]

    threads = [threading.Thread(target=worker, args=(i, rid)) for i, rid in enumerate(("x", "y"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone



@RUNNERS
def test_whole_decode_step_graphs_pad_rows_and_keep_state(where: str):
    """Decode-only steps replay as one graph (graphs NOTE 6): 3 sequences pad to 4 rows and a
    longer one joins later (another table width), a kept session sits in the cache meanwhile.
    Tokens equal the piecewise run's, and so does every slot and block of the cache afterwards:
    pad rows write nothing of their own, and capturing does not advance a state twice (NOTE 7)."""
    model = _graph_model(where)

    def run(decode_graphs: bool):
        eng = _engine(model, graphs=True, decode_graphs=decode_graphs)
        kept = eng.generate(EngineRequest("k", _prompt(150, 9), SamplingParams(max_tokens=3, ignore_eos=True),
                                          keep_state=True))[0]
        for i, n in enumerate((70, 20, 130)):
            eng.add_request(EngineRequest(f"s{i}", _prompt(n, 10 + i), SamplingParams(max_tokens=20, ignore_eos=True)))
        out = {"k": kept}
        steps = 0
        while eng.has_work():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            steps += 1
            if steps == 6:  # a long prompt joins: wider tables once it decodes
                eng.add_request(EngineRequest("late", _prompt(300, 20), SamplingParams(max_tokens=8, ignore_eos=True)))
        c = eng.cache
        return out, (c.mla_all.float().cpu(), c.conv_all.float().cpu(), c.rec_all.float().cpu())

    piecewise, cache_p = run(False)
    runner = model.step_graphs()
    before = runner.decode_captures
    whole, cache_w = run(True)
    assert runner.decode_failed is None and runner.decode_captures >= before + 2  # 4 rows, then 4 rows wider
    assert whole == piecewise
    tol = dict(rtol=0.05, atol=0.05) if where == "cuda" else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(cache_w, cache_p, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_decode_steps_over_the_gather_limit_run_piecewise(monkeypatch):
    """A decode step whose padded key gather passes the limit (graphs NOTE 8) runs piecewise, with
    the same tokens; under the limit the same steps replay whole."""
    import disagg.engine.reference.graphs as graphs_mod

    def decode(limit: int) -> tuple[list[int], int]:
        monkeypatch.setattr(graphs_mod, "MAX_DECODE_GATHER_BYTES", limit)
        model = _graph_model("stand-in")
        eng = _engine(model, graphs=True)
        for i in range(3):
            eng.add_request(EngineRequest(f"r{i}", _prompt(100, i), SamplingParams(max_tokens=6, ignore_eos=True)))
        out: list[int] = []
        while eng.has_work():
            for o in eng.step():
                out.extend(o.new_token_ids)
        return out, model.step_graphs().decode_captures

    # 3 rows pad to 4, tables of 2 blocks to 2: 4 x 2 x 64 x latent x 4 bytes
    latent = load_preset("tiny").kv_lora_rank + load_preset("tiny").qk_rope_head_dim
    need = 4 * 2 * 64 * latent * 4
    whole, captured = decode(need)
    piecewise, none = decode(need - 1)
    assert captured >= 1 and none == 0 and whole == piecewise


def test_decode_graphs_go_with_their_cache():
    """A cache keeps the decode graphs bound to its pools (graphs NOTE 6): an engine dropped from a
    model that lives on frees its cache, graphs included."""
    model = _graph_model("stand-in")
    eng = _engine(model, graphs=True)
    for i in range(2):
        eng.add_request(EngineRequest(f"r{i}", _prompt(30 + i, i), SamplingParams(max_tokens=4, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    runner = model.step_graphs()
    assert eng.cache.decode_graphs.get(runner)  # the decodes ran as whole-step graphs
    cache = weakref.ref(eng.cache)
    del eng
    gc.collect()
    assert cache() is None and runner.decode_captures >= 1


def test_moving_or_casting_the_weights_drops_the_runner():
    """Graphs read the weights where they were at capture (graphs NOTE 4): ``Module.to`` and
    ``cast_model`` drop the runner, so the next step captures against the new tensors."""
    from disagg.engine.reference.model import cast_model

    model = K3ForCausalLM.random_init(load_preset("tiny"), seed=0)
    model._graphs = stale = object()
    model.to(torch.float64)
    assert model._graphs is None
    model._graphs = stale
    cast_model(model, torch.bfloat16)
    assert model._graphs is None
