"""The reference engine: scheduling, state export/import, residency, exactness."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM

BS = 64


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=torch.float32).eval()


def make_engine(model, **kw) -> ReferenceEngine:
    opts = dict(block_size=BS, max_num_batched_tokens=128, checkpoint_interval=BS, cache_budget_bytes=64 << 20,
                max_num_seqs=8, capture_logits=True)
    opts.update(kw)
    return ReferenceEngine(model, "tiny-test", EngineOptions(**opts))


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine: ReferenceEngine, rid: str, tokens, n: int, **kw):
    out, last = engine.generate(EngineRequest(rid, tokens, greedy(n), **kw))
    return out, last, engine.last_logits[rid]


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    err = (a - b).abs().max() / b.abs().max()
    assert err < rtol, f"relative error {err:.2e}"


@pytest.mark.parametrize("position", [64, 128, 192, 256])
def test_resume_at_block_boundary_matches_uninterrupted_run(model, position):
    p = prompt(300)
    a = make_engine(model)
    ref_tokens, _, ref_logits = run(a, "a", p, 8, keep_state=True)
    state = a.export_state("a", position)
    assert state.position == position and state.tail is None and len(state.mla_blocks) == position // BS
    b = make_engine(model, resident_sessions=False)
    tokens, last, logits = run(b, "b", p, 8, resume=state)
    assert tokens == ref_tokens
    assert last.num_cached_tokens == position
    assert_close(logits, ref_logits)


def test_resume_at_unaligned_turn_end_matches_recompute(model):
    p1 = prompt(150)
    a = make_engine(model)
    out1, _, _ = run(a, "t1", p1, 10, keep_state=True)
    computed = a.computed_tokens("t1")
    assert len(computed) == 150 + 10 - 1 and computed[-1] != None  # noqa: E711
    state = a.export_state("t1")
    assert state.position % BS != 0 and state.tail is not None
    p2 = p1 + out1 + prompt(40, seed=2)
    fresh = make_engine(model, resident_sessions=False)
    ref_tokens, _, ref_logits = run(fresh, "full", p2, 8)
    b = make_engine(model, resident_sessions=False)
    tokens, last, logits = run(b, "resumed", p2, 8, resume=state)
    assert last.num_cached_tokens == len(computed)
    assert tokens == ref_tokens
    assert_close(logits, ref_logits)


def test_turn_two_adopts_device_resident_state(model):
    eng = make_engine(model)
    p1 = prompt(200)
    out1, _, _ = run(eng, "s1", p1, 6)
    p2 = p1 + out1 + prompt(30, seed=3)
    tokens, last, _ = run(eng, "s2", p2, 6)
    assert last.cached_source == "device" and last.num_cached_tokens == 200 + 6 - 1
    ref, _, _ = run(make_engine(model, resident_sessions=False), "ref", p2, 6)
    assert tokens == ref


def test_residents_are_not_shared_across_cache_salts(model):
    eng = make_engine(model)
    p1 = prompt(200)
    out1, _, _ = run(eng, "s1", p1, 4, cache_salt="tenant-a")
    _, last, _ = run(eng, "s2", p1 + out1 + [5], 2, cache_salt="tenant-b")
    assert last.num_cached_tokens == 0


def test_greedy_tokens_do_not_depend_on_batch(model):
    solo = make_engine(model)
    target = prompt(180, seed=7)
    ref, _, ref_logits = run(solo, "x", target, 12)
    eng = make_engine(model, max_num_batched_tokens=256)
    for i, n in enumerate((70, 130, 260)):
        eng.add_request(EngineRequest(f"other{i}", prompt(n, seed=10 + i), greedy(9)))
    eng.add_request(EngineRequest("x", target, greedy(12)))
    got: list[int] = []
    while eng.has_work():
        for o in eng.step():
            if o.request_id == "x":
                got.extend(o.new_token_ids)
    assert got == ref
    assert_close(eng.last_logits["x"], ref_logits, rtol=1e-4)


def test_preemption_under_memory_pressure_keeps_outputs(model):
    reqs = {f"r{i}": prompt(100 + 20 * i, seed=20 + i) for i in range(4)}
    refs = {rid: run(make_engine(model), rid, p, 40)[0] for rid, p in reqs.items()}
    # room for ~10 blocks: four requests growing to 3-4 blocks each must preempt
    layout_bytes = make_engine(model).geometry
    budget = layout_bytes.slot_bytes * 4 + layout_bytes.block_bytes * 10
    eng = make_engine(model, cache_budget_bytes=budget, max_num_seqs=4, resident_sessions=False)
    for rid, p in reqs.items():
        eng.add_request(EngineRequest(rid, p, greedy(40)))
    got = {rid: [] for rid in reqs}
    while eng.has_work():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    assert eng.counters["preemptions"] > 0
    assert got == refs
    assert eng.cache.blocks.num_free == eng.geometry.num_blocks


def test_load_reports_the_device_capacity_in_tokens(model):
    """A router bounds per-request terms by a share of the device (``device_tokens``)."""
    eng = make_engine(model, cache_budget_bytes=8 << 20)
    load = eng.load()
    assert load["device_tokens"] == eng.geometry.num_blocks * eng.block_size > 0
    assert load["cache_utilization"] == 0.0


def test_refuses_requests_that_can_never_fit(model):
    eng = make_engine(model, cache_budget_bytes=8 << 20)
    too_long = eng.max_tokens_per_request
    with pytest.raises(ValueError, match="holds at most"):
        eng.add_request(EngineRequest("big", prompt(too_long), greedy(1)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request(EngineRequest("bad", [1, 2, 10**6], greedy(1)))
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request(EngineRequest("empty", [], greedy(1)))


def test_abort_frees_blocks_and_slot(model):
    eng = make_engine(model, resident_sessions=False)
    eng.add_request(EngineRequest("a", prompt(300), greedy(50)))
    eng.step()
    assert eng.cache.blocks.num_free < eng.geometry.num_blocks
    outs = eng.abort("a")
    assert outs and outs[0].finish_reason == "abort"
    assert eng.cache.blocks.num_free == eng.geometry.num_blocks
    assert eng.cache.num_free_slots == eng.geometry.num_slots
    assert not eng.has_work()


def test_seeded_sampling_is_split_invariant(model):
    """Tokens sampled with a seed are the same whether one engine samples them all or two split them."""
    p = prompt(100)
    sp = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    a = make_engine(model)
    whole, _ = a.generate(EngineRequest("w", p, sp, keep_state=True))
    first, _ = make_engine(model).generate(
        EngineRequest("p", p, SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1234), keep_state=True))
    assert first == whole[:1]
    b = make_engine(model)
    pre = make_engine(model)
    pre.generate(EngineRequest("p", p, SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, seed=1234),
                               keep_state=True))
    state = pre.export_state("p")
    rest, _ = b.generate(EngineRequest("d", p + first, SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9,
                                                                       seed=1234, ignore_eos=True),
                                       resume=state, first_output_index=1))
    assert first + rest == whole


def test_stop_token_and_max_tokens(model):
    eng = make_engine(model)
    out, last = eng.generate(EngineRequest("a", prompt(50), greedy(5)))
    assert len(out) == 5 and last.finish_reason == "length"
    stop = out[2]
    out2, last2 = eng.generate(EngineRequest("b", prompt(50), SamplingParams(max_tokens=5, stop_token_ids=(stop,))))
    assert out2[-1] == stop and last2.finish_reason == "stop" and len(out2) <= 3


def test_replayed_turn_resumes_at_the_prompt_end_checkpoint(model):
    """A trace replay sends the recorded reply, not the generated one: the prompt-end checkpoint still hits."""
    eng = make_engine(model)
    p1 = prompt(200)
    out1, _, _ = run(eng, "s1", p1, 6)
    recorded_reply = [t + 1 for t in out1]  # differs from what the engine generated
    p2 = p1 + recorded_reply + prompt(30, seed=3)
    tokens, last, logits = run(eng, "s2", p2, 6)
    assert last.cached_source == "device" and last.num_cached_tokens == len(p1)
    ref, _, ref_logits = run(make_engine(model, resident_sessions=False), "ref", p2, 6)
    assert tokens == ref
    assert_close(logits, ref_logits)
    kept = sum(len(c.pages) for r in eng._residents.values() for c in r.checkpoints.values())
    assert kept == eng.stats()["checkpoint_blocks"] > 0  # the residents' KDA states, in pages (engine NOTE 10)
    assert eng.cache.blocks.num_free + sum(len(r.block_table) for r in eng._residents.values()) + kept == \
        eng.geometry.num_blocks, "pages past the resume point went back to the pool"


def test_common_prefix_matches_a_token_by_token_scan():
    """The chunked comparison behind ``resident_match`` (slices compared in C) against the plain
    scan, at chunk edges, with distinct int objects and mixed sequence types."""
    import random

    from disagg.engine.reference.engine import _PREFIX_CHUNK, _common_prefix

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    edges = [0, 1, _PREFIX_CHUNK - 1, _PREFIX_CHUNK, _PREFIX_CHUNK + 1, 3 * _PREFIX_CHUNK]
    for _ in range(300):
        n = rng.choice(edges + [rng.randrange(4 * _PREFIX_CHUNK)])
        a = [rng.randrange(300, 310) for _ in range(n)]
        k = rng.choice([n, rng.randrange(n + 1)] + [e for e in edges if e <= n])
        b = [int(str(t)) for t in a[:k]] + [rng.randrange(300, 310) for _ in range(rng.randrange(2 * _PREFIX_CHUNK))]
        assert _common_prefix(a, b) == scan(a, b) == _common_prefix(tuple(a), b)


def _crowded(model, prompts: list[list[int]]) -> ReferenceEngine:
    """Prefill ``prompts`` together (keep_state) through a step budget far below their sum."""
    eng = make_engine(model, max_num_batched_tokens=128, checkpoint_interval=0)
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"p{i}", p, greedy(1), keep_state=True))
    while eng.has_work():
        eng.step()
    return eng


def test_aligned_checkpoint_survives_prefills_chunked_by_a_crowded_batch(model):
    """Six long prompts share every step (128-token budget); each keeps its last-full-block
    checkpoint (NOTE 5), and a follow-up diverging inside that partial block resumes there,
    token-exact against an uninterrupted run."""
    lens = [300, 455, 517, 390, 333, 250]
    firsts = [prompt(n, seed=10 + i) for i, n in enumerate(lens)]
    eng = _crowded(model, firsts)
    assert eng.counters["steps"] >= sum(lens) // 128, "the prefills shared their steps"
    for i, n in enumerate(lens):
        assert n // BS * BS in eng.checkpoint_positions(f"p{i}"), f"prompt {n}: no checkpoint at {n // BS * BS}"
    for i in (1,):  # a follow-up: the predecessor's full blocks, then new tokens inside its partial block
        aligned = lens[i] // BS * BS
        follow = firsts[i][:aligned] + prompt(40, seed=90 + i)
        state = eng.export_state(f"p{i}", aligned)
        b = make_engine(model, resident_sessions=False)
        tokens, last, logits = run(b, "b", follow, 6, resume=state)
        assert last.num_cached_tokens == aligned
        ref, _, ref_logits = run(make_engine(model, resident_sessions=False), "ref", follow, 6)
        assert tokens == ref
        assert_close(logits, ref_logits)


def test_requested_checkpoints_are_kept_whatever_the_step(model):
    """``checkpoint_at`` (NOTE 7): kept in a crowded batch, and a bad position is refused."""
    lens = [455, 610, 517]
    eng = make_engine(model, max_num_batched_tokens=128, checkpoint_interval=0)
    wanted = {0: (192, 320), 1: (64, 448), 2: (256,)}
    for i, n in enumerate(lens):
        eng.add_request(EngineRequest(f"p{i}", prompt(n, seed=i), greedy(1), keep_state=True,
                                      checkpoint_at=wanted[i]))
    while eng.has_work():
        eng.step()
    for i, n in enumerate(lens):
        assert eng.checkpoint_positions(f"p{i}") == sorted({*wanted[i], n // BS * BS, n})
    with pytest.raises(ValueError, match="block boundary"):
        eng.add_request(EngineRequest("bad", prompt(300), greedy(1), keep_state=True, checkpoint_at=(100,)))
    with pytest.raises(ValueError, match="inside the prompt"):
        eng.add_request(EngineRequest("bad", prompt(300), greedy(1), keep_state=True, checkpoint_at=(320,)))


def test_a_shared_prefix_match_copies_and_leaves_the_resident_to_its_session(model):
    """NOTE 2: another session resuming at A's shared 128-token prefix copies those pages; A's own
    next turn still finds A's state (and its prompt-end checkpoint), token-exact."""
    eng = make_engine(model, checkpoint_interval=0)
    system = prompt(128, seed=50)
    a = system + prompt(300, seed=51)
    eng.add_request(EngineRequest("a2", a, greedy(1), keep_state=True, checkpoint_at=(128,)))
    while eng.has_work():
        eng.step()
    eng.release("a2")
    other = system + prompt(90, seed=52)
    _, last_other, _ = run(eng, "o", other, 3)
    assert last_other.num_cached_tokens == 128 and last_other.cached_source == "device"
    follow = a + prompt(20, seed=53)
    tokens, last, logits = run(eng, "a3", follow, 4)
    assert last.num_cached_tokens == len(a) and last.cached_source == "device"
    ref, _, ref_logits = run(make_engine(model, resident_sessions=False), "ref", follow, 4)
    assert tokens == ref
    assert_close(logits, ref_logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_sampling_logits_distribution(model, temperature):
    """Each token's entry is log_softmax of the very logits it was sampled from (before
    temperature), the alternatives most likely first; asking for them changes no token."""
    p = prompt(70)
    sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature, seed=3)
    plain, _ = make_engine(model).generate(EngineRequest("a", p, sp))
    engine = make_engine(model)
    rid = "b"
    engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature,
                                                            seed=3, logprobs=3)))
    tokens = []
    while engine.has_work():
        for out in engine.step():
            assert len(out.logprobs) == len(out.new_token_ids) == 1
            entry, token = out.logprobs[0], out.new_token_ids[0]
            logp = torch.log_softmax(engine.last_logits[rid].float(), -1)
            assert entry.logprob == pytest.approx(logp[token].item(), abs=1e-6)
            want = torch.topk(logp, 3)
            assert [t for t, _ in entry.top] == want.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(want.values.tolist(), abs=1e-6)
            if temperature == 0.0:
                assert entry.top[0][0] == token
            tokens.append(token)
    assert tokens == plain


def test_no_logprobs_unless_asked(model):
    engine = make_engine(model)
    engine.add_request(EngineRequest("a", prompt(10), greedy(2)))
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs and all(o.logprobs is None for o in outs)


def test_logprobs_beyond_the_engines_limit_are_refused():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def _resident(eng: ReferenceEngine, tokens: list[int]) -> None:
    """A finished, released request: its state stays on the device as a resident session."""
    eng.add_request(EngineRequest("r0", tokens, greedy(1), keep_state=True))
    while eng.has_work():
        eng.step()
    eng.release("r0")


def test_requests_that_repeat_a_residents_prompt_each_copy_it(model):
    """NOTE 2: n choices of one prompt (or retries) cannot be the resident session's next turn:
    each resumes from a copy at its last full block, token-exact, and the resident stays."""
    eng = make_engine(model, checkpoint_interval=0)
    p = prompt(300, seed=60)
    _resident(eng, p)
    ref, _, _ = run(make_engine(model, resident_sessions=False), "ref", p, 4)
    for i in range(3):
        tokens, last, _ = run(eng, f"c{i}", p, 4)
        assert (last.num_cached_tokens, last.cached_source) == (256, "device") and tokens == ref


def test_queued_requests_resuming_from_one_resident_all_get_it(model):
    """NOTE 2: two requests queued together that both extend a resident's 256-token checkpoint
    (subagents forked from one context): the first copies, the second adopts; both resume there."""
    eng = make_engine(model, checkpoint_interval=0)
    p = prompt(300, seed=61)
    _resident(eng, p)
    forks = [p[:256] + prompt(40, seed=62), p[:256] + prompt(50, seed=63)]
    for i, tokens in enumerate(forks):
        eng.add_request(EngineRequest(f"f{i}", tokens, greedy(3)))
    last = {}
    while eng.has_work():
        for out in eng.step():
            last[out.request_id] = out
    assert [(last[f"f{i}"].num_cached_tokens, last[f"f{i}"].cached_source) for i in range(2)] == [(256, "device")] * 2
    assert all(tokens[:300] != p for _, tokens, _ in eng.resident_contents())  # the last one took it over


@pytest.mark.parametrize("source", ["host", "device"])
def test_a_resumed_request_keeps_the_checkpoint_a_computed_one_would(model, source):
    """A request resumed at its prompt's last block boundary (from a loaded state, or from a
    resident session by adoption) keeps the KDA state there, as NOTE 5 has a computed one keep it:
    without it a third prompt on the same document found no resident checkpoint at the
    document's end and computed it (two workers answering questions on shared documents in
    turn: ``benchmarks/mates_replay.py``)."""
    doc = prompt(8 * BS, seed=5)
    eng = make_engine(model, checkpoint_interval=0)
    run(eng, "a", doc + prompt(40, seed=6), 1, keep_state=True)
    assert 8 * BS in eng.checkpoint_positions("a")  # computed: NOTE 5's aligned point
    state = eng.export_state("a", 8 * BS)
    eng.release("a", keep_resident=source == "device")
    _, last, _ = run(eng, "b", doc + prompt(40, seed=7), 1, keep_state=True,
                     **({"resume": state} if source == "host" else {}))
    assert last.num_cached_tokens == 8 * BS and last.cached_source == source
    assert 8 * BS in eng.checkpoint_positions("b"), "resumed there: the checkpoint is kept"
    eng.release("b")
    third = doc + prompt(40, seed=8)
    tokens, last, _ = run(eng, "c", third, 4)
    assert last.num_cached_tokens == 8 * BS and last.cached_source == "device"
    ref, _, _ = run(make_engine(model, resident_sessions=False), "ref", third, 4)
    assert tokens == ref
