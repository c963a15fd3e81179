"""Transfer faults in process: dropped, stalled and corrupted state loads all end in a recompute
whose output equals the uninterrupted run; and the injector's decisions themselves."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

from disagg.config import AppConfig, FaultConfig, FaultRule, load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.faults import FaultInjector, InjectedCrash, read_ledger
from disagg.flow import FlowOptions
from disagg.launch.inprocess import make_local_store
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker, continue_params


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
                       "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}}})
    engine = build_reference_engine(cfg)  # one torch thread: the tiny model gains nothing from more
    yield cfg, engine
    torch.set_num_threads(threads)


def _reference(engine, prompt: list[int], n: int) -> list[int]:
    ref = ReferenceEngine(engine.model, engine.model_id, engine.options)
    tokens, _ = ref.generate(EngineRequest("ref", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    return tokens


class _Pair:
    """A decode worker (with the injector) and a prefill worker sharing one host tier."""

    def __init__(self, model, rules: list[dict], deadline_s: float = 5.0, ledger: str | None = None):
        cfg, engine = model
        self.store = make_local_store(cfg, engine.layout)
        self.faults = FaultInjector(FaultConfig(enabled=True, rules=rules, ledger_path=ledger), "decode-0", "decode")
        decode_engine = ReferenceEngine(engine.model, engine.model_id, engine.options)
        prefill_engine = ReferenceEngine(engine.model, engine.model_id, engine.options)
        self.decode = StatefulWorker(AsyncEngine(decode_engine), self.store, "decode-0",
                                     options=FlowOptions(DeciderConfig(local_prefill_max_tokens=64), load_deadline_s=deadline_s),
                                     faults=self.faults)
        self.prefill = StatefulWorker(AsyncEngine(prefill_engine), self.store, "prefill-0",
                                      options=FlowOptions(DeciderConfig(local_prefill_max_tokens=64)))

    def run(self, params: GenerateParams) -> list[int]:
        async def collect():
            out = []
            async for chunk in self.decode.generate(params, self.prefill.prefill):
                assert chunk.error is None, chunk.error
                out.extend(chunk.token_ids)
            await self.decode.drain()
            return out

        return asyncio.run(collect())

    def close(self):
        self.decode.engine.shutdown()
        self.prefill.engine.shutdown()


def _params(prompt, n=8, session="s", rid="r1") -> GenerateParams:
    return GenerateParams(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), session_id=session)


@pytest.mark.parametrize("fault", ["drop", "delay", "corrupt"])
def test_faulty_state_load_recomputes_the_same_tokens(model, fault, tmp_path):
    ledger = str(tmp_path / "faults.jsonl")
    pair = _Pair(model, [{"fault": fault, "rate": 1.0, "delay_s": 30.0}], deadline_s=1.0, ledger=ledger)
    try:
        prompt = _ids(300, 1)
        t0 = time.monotonic()
        got = pair.run(_params(prompt))
        elapsed = time.monotonic() - t0
        assert got == _reference(model[1], prompt, 8)
        c = pair.decode.counters
        assert c["remote_prefills"] == 1, "the state came by handle from the prefill worker"
        assert c["load_failures"] == 1, "the faulty load was abandoned and the prompt recomputed"
        lines = read_ledger(ledger)
        assert [(e.get("fault"), e.get("recovery"), e.get("after")) for e in lines] == [
            (fault, None, None), (None, "load_recomputed", fault)]
        store = pair.store.stats()
        if fault == "delay":
            assert c["load_timeouts"] == 1 and elapsed < 30.0, "the deadline cut the 30 s stall short"
        if fault == "corrupt":
            assert store["num_corrupt_pieces"] >= 1, "the checksum caught the flipped byte"
    finally:
        pair.close()


def test_prefill_killed_mid_request_is_retried_and_leaks_nothing(model, tmp_path):
    """A prefill that dies after computing the prompt (``InjectedCrash`` in process, where no
    replica may exit) is retried; the killed attempt's kept state is released."""
    ledger = str(tmp_path / "faults.jsonl")
    pair = _Pair(model, [{"fault": "drop", "rate": 1.0, "session_prefix": "never"}], ledger=ledger)
    rules = [FaultRule(fault="kill_prefill", nth=1)]
    pair.prefill.faults = FaultInjector(FaultConfig(enabled=True, rules=rules, ledger_path=ledger),
                                        "prefill-0", "prefill")
    pair.decode.flow.options.retry_backoff_s = 0.0
    try:
        prompt = _ids(300, 5)
        assert pair.run(_params(prompt, rid="kp-1")) == _reference(model[1], prompt, 8)
        assert pair.decode.counters["prefill_failures"] == 1 and pair.decode.counters["remote_prefills"] == 1
        assert [(e.get("fault"), e.get("recovery"), e["role"]) for e in read_ledger(ledger)] == [
            ("kill_prefill", None, "prefill"), (None, "prefill_retried", "decode")]
        held = asyncio.run(pair.prefill.engine.call(lambda: pair.prefill.engine.engine.stats()["held"]))
        assert held == 0, "neither the killed attempt nor the retry left its prefill state held"
    finally:
        pair.close()


def test_without_faults_the_handle_loads(model):
    pair = _Pair(model, [{"fault": "drop", "rate": 1.0, "session_prefix": "never"}])
    try:
        prompt = _ids(300, 2)
        assert pair.run(_params(prompt)) == _reference(model[1], prompt, 8)
        assert pair.decode.counters["load_failures"] == 0 and pair.faults.counters == {}
    finally:
        pair.close()


def test_resumed_request_continues_exactly_where_the_stream_stopped(model):
    """What the ingress sends after losing a decode replica: prompt + streamed tokens, the rest to go."""
    pair = _Pair(model, [{"fault": "drop", "rate": 1.0, "session_prefix": "never"}])
    try:
        prompt = _ids(200, 3)
        want = _reference(model[1], prompt, 12)
        for streamed in (1, 7):
            cont = continue_params(_params(prompt, 12, rid=f"k{streamed}"), want[:streamed], 1)
            assert cont.resumed_output_tokens == streamed and cont.sampling.max_tokens == 12 - streamed
            assert want[:streamed] + pair.run(cont) == want
        assert pair.decode.counters["resumed_requests"] == 2
    finally:
        pair.close()


def test_seeded_sampling_resumes_at_the_right_output_index(model):
    pair = _Pair(model, [{"fault": "drop", "rate": 1.0, "session_prefix": "never"}])
    try:
        prompt = _ids(100, 4)
        sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
        whole = pair.run(GenerateParams("w", prompt, sampling))
        cont = continue_params(GenerateParams("c", prompt, sampling), whole[:4], 1)
        assert whole[:4] + pair.run(cont) == whole
    finally:
        pair.close()


def test_in_process_kill_fails_the_request_loudly(model):
    pair = _Pair(model, [{"fault": "kill_decode", "nth": 1, "after_tokens": 2}])
    try:
        with pytest.raises(InjectedCrash):
            pair.run(_params(_ids(40, 5), 6))
        assert pair.faults.counters == {"kill_decode": 1}
    finally:
        pair.close()


# -- the injector's decisions ---------------------------------------------------------------
def _injector(rules, **kw) -> FaultInjector:
    return FaultInjector(FaultConfig(enabled=True, rules=[FaultRule(**r) for r in rules], **kw), "replica-1")


def test_faults_are_off_by_default_and_when_disabled():
    assert AppConfig().faults.enabled is False
    off = FaultInjector(FaultConfig(enabled=False, rules=[FaultRule(fault="drop", rate=1.0)]), "r")
    assert not off.enabled and off.on_load(_params([1])) is None


def test_a_rule_that_never_fires_is_a_config_error():
    with pytest.raises(ValueError, match="never fires"):
        FaultRule(fault="drop")
    with pytest.raises(ValueError):
        FaultRule(fault="drop", rate=1.5)


def test_nth_fires_once_and_session_prefix_selects():
    inj = _injector([{"fault": "corrupt", "nth": 3, "session_prefix": "x-"}])
    seen = [inj.on_load(_params([1], session=s)) for s in ("x-1", "y-1", "x-2", "x-3", "x-4", None)]
    assert [f.kind if f else None for f in seen] == [None, None, None, "corrupt", None, None]


def test_rate_draws_are_seeded_per_replica():
    rules = [{"fault": "drop", "rate": 0.3}]
    a = [_injector(rules).on_load(_params([1])) is not None for _ in range(200)]
    b = [_injector(rules).on_load(_params([1])) is not None for _ in range(200)]
    assert a == b  # fresh injectors with the same seed: the same decisions
    inj = _injector(rules)
    hits = sum(inj.on_load(_params([1])) is not None for _ in range(2000))
    assert 450 < hits < 750


def test_a_request_is_killed_at_most_once(tmp_path):
    ledger = str(tmp_path / "ledger.jsonl")
    rules = [{"fault": "kill_prefill", "rate": 1.0}, {"fault": "kill_decode", "rate": 1.0, "after_tokens": 3}]
    inj = _injector(rules, ledger_path=ledger)
    p = _params([1, 2, 3], rid="req-1")
    assert inj.should_kill_prefill(p)
    with pytest.raises(InjectedCrash):
        inj.kill("kill_prefill", p)
    other = _injector(rules, ledger_path=ledger)  # another replica reads the same ledger
    assert not other.should_kill_prefill(p), "a retried prefill is not killed again"
    assert other.kill_decode_after(p) is None
    assert other.kill_decode_after(_params([1], rid="req-2")) == 3
    cont = continue_params(_params([1, 2, 3], rid="req-2"), [9], 1)
    assert cont.request_id == "req-2~1"
    assert other.kill_decode_after(cont) is None, "a continued stream is not killed again"
    lines = [json.loads(x) for x in open(ledger)]
    assert [(e["fault"], e["request_id"]) for e in lines] == [("kill_prefill", "req-1")]
