"""P/D hand-off between a producer and a consumer vLLM scheduler through kv_transfer_params."""

from __future__ import annotations

import uuid

import k3_harness as H
import pytest
from k3_harness import GatedTier, baseline, make_tier

pytestmark = pytest.mark.vllm

PROMPT = H.prompt(700, seed=11)


def _pair(tier_name: str, producer_extra: dict | None = None):
    p = H.Engine(H.vllm_config(role="kv_producer", tier=tier_name, engine_id="prefill-0", extra=producer_extra))
    d = H.Engine(H.vllm_config(role="kv_consumer", tier=tier_name, engine_id="decode-0"))
    return p, d


def _prefill(p) -> tuple[int, dict]:
    p.add("r", PROMPT, max_tokens=1, kv_params={"do_remote_decode": True})
    p.run()
    done = p.finished["r"]
    assert done.reason == "length" and len(done.tokens) == 1
    return done.tokens[0], done.kv_transfer_params


def test_handoff_resumes_at_the_prompt_end():
    """Our flow: decode gets prompt + the prefill's first token and resumes at the prompt end."""
    name, _ = make_tier()
    p, d = _pair(name)
    first, params = _prefill(p)
    handle = params["disagg_state"]
    assert params["do_remote_prefill"] is True and handle["position"] == 700
    assert (handle["tp_size"], handle["dcp_size"], handle["producer"]) == (1, 1, "prefill-0")
    d.add("r", PROMPT + [first], max_tokens=3, kv_params=params)
    d.run()
    (load,) = [j for s in d.step_log for j in s["loads"]]
    assert load.position == 700 and not any(s["failed"] for s in d.step_log)
    assert sum(s["scheduled"].get("r", 0) for s in d.step_log) == 3  # token 700, then two decodes
    full = baseline(PROMPT, 4)
    assert [first] + d.outputs["r"] == full


def test_handoff_with_the_same_prompt_resumes_at_the_last_checkpoint():
    """vLLM's native P/D flow (decode sees the same prompt): the last token must be computed
    on decode, so it resumes at the producer's last checkpoint below the prompt end."""
    name, _ = make_tier()
    p, d = _pair(name)
    first, params = _prefill(p)
    d.add("r", PROMPT, max_tokens=3, kv_params=params)
    d.run()
    (load,) = [j for s in d.step_log for j in s["loads"]]
    assert load.position == 640  # the boundary checkpoint the producer saved while prefilling
    assert d.outputs["r"] == baseline(PROMPT, 3)
    assert d.outputs["r"][0] == first


def test_consumer_waits_for_an_inflight_save_then_loads():
    from kv_transfer.vllm.stores import register_local_tier

    tier = GatedTier()
    name = f"gated-{uuid.uuid4().hex[:8]}"
    register_local_tier(name, tier)
    p, d = _pair(name, producer_extra={"async_saves": True})
    p.add("r", PROMPT, max_tokens=1, kv_params={"do_remote_decode": True})
    for _ in range(4):
        p.step()
    params = p.finished["r"].kv_transfer_params  # returned before the state is stored
    d.add("r", PROMPT + p.finished["r"].tokens, max_tokens=2, kv_params=params)
    for _ in range(3):
        d.step()
    assert d.connector._sched.counters["waits"] == 3  # get_num_new_matched_tokens -> None: ask again
    assert not any(s["scheduled"] for s in d.step_log)
    tier.gate.set()
    p.run()
    d.run()
    (load,) = [j for s in d.step_log for j in s["loads"]]
    assert load.position == 700
    assert p.finished["r"].tokens + d.outputs["r"] == baseline(PROMPT, 3)


def test_handoff_that_never_lands_falls_back_to_recompute():
    name, _ = make_tier()
    d = H.Engine(H.vllm_config(role="kv_consumer", tier=name, engine_id="decode-0", extra={"handle_wait_s": 0.05}))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "disagg_state": {
        "position": 700, "tp_size": 1, "dcp_size": 1, "model_id": H.MODEL_ID, "block_size": 128}}
    d.add("r", PROMPT + [5], max_tokens=2, kv_params=params)
    d.run()
    assert not [j for s in d.step_log for j in s["loads"]]
    assert sum(s["scheduled"].get("r", 0) for s in d.step_log) == 702
    assert d.outputs["r"] == baseline(PROMPT + [5], 2)


def test_handle_of_another_layout_is_not_used():
    name, _ = make_tier()
    p, d = _pair(name)
    first, params = _prefill(p)
    params["disagg_state"]["model_id"] = "another-model"
    d.add("r", PROMPT + [first], max_tokens=2, kv_params=params)
    d.run()
    # the handle is ignored; the consumer's own lookup (same node's tier, its own key space) still hits
    (load,) = [j for s in d.step_log for j in s["loads"]]
    assert load.position == 700
    assert d.connector._sched.counters["waits"] == 0
