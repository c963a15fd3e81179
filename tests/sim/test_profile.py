"""Profile files: fitting, the named profiles, errors."""

from __future__ import annotations

import json

import pytest

from disagg.costs.model import CostModel
from disagg.costs.profile import (
    DecodePoint,
    EngineProfile,
    PrefillPoint,
    chunk_steps,
    cost_profile,
    load_profile,
    profile_names,
)

TRUE = CostModel(prefill_base_s=0.02, prefill_per_token_s=5e-4, prefill_attn_s=2e-8,
                 decode_base_s=0.01, decode_per_seq_s=2e-3, decode_per_ctx_token_s=1e-7, max_prefill_tokens_per_step=512)


def synthetic(name="syn", batches=(1, 8)) -> EngineProfile:
    pre = []
    for n, ctx in ((64, 0), (512, 0), (2048, 0), (256, 1024), (1024, 4096)):
        steps = chunk_steps(n, ctx, 512, 64)
        pre.append(PrefillPoint(n, ctx, TRUE.prefill_base_s * steps + TRUE.prefill_job_time(n, ctx)))
    dec = [DecodePoint(b, c, TRUE.decode_step_time(b, b * c)) for b in batches for c in (256, 4096)]
    return EngineProfile(name, {"kind": "measured"}, block_size=64, prefill=pre, decode=dec,
                         limits={"max_prefill_tokens_per_step": 512})


def test_fit_recovers_the_generating_model():
    cm = synthetic().cost_model()
    for key in ("prefill_base_s", "prefill_per_token_s", "prefill_attn_s", "decode_base_s", "decode_per_seq_s",
                "decode_per_ctx_token_s"):
        assert getattr(cm, key) == pytest.approx(getattr(TRUE, key), rel=1e-6), key
    rep = synthetic().fit_report()
    assert rep.prefill_max_rel_err < 1e-6 and rep.decode_max_rel_err < 1e-6


def test_three_batch_sizes_fit_a_batch_curve():
    cm = synthetic(batches=(1, 8, 64)).cost_model()
    assert [b for b, _ in cm.decode_batch_curve] == [1, 8, 64]
    for b in (1, 8, 64):
        assert cm.decode_step_time(b, b * 1000) == pytest.approx(TRUE.decode_step_time(b, b * 1000), rel=1e-6)
    assert cm.decode_step_time(4, 0) == pytest.approx(TRUE.decode_step_time(4, 0), rel=1e-6)  # linear in between


def test_chunk_steps_follow_the_engine():
    assert chunk_steps(1024, 0, 512, 64) == 2
    assert chunk_steps(1000, 30, 512, 64) == 3  # chunks end on block boundaries: 482, 512, 6
    assert chunk_steps(10, 0, 512, 64) == 1


def test_round_trip_and_named_profiles(tmp_path):
    p = synthetic().save(tmp_path / "syn.json")
    again = load_profile(p)
    assert again.cost_model() == synthetic().cost_model()
    names = profile_names()
    assert {"cpu-tiny", "h200-small", "mi355x-k3"} <= set(names)
    for name in names:
        prof = load_profile(name)
        cm = cost_profile(name)
        assert prof.source["kind"] in ("measured", "published", "roofline", "bench-fit")
        assert cm.prefill_time(1024) > 0 and cm.decode_step_time(8, 8 * 4096) > 0
    k3 = load_profile("mi355x-k3")
    assert k3.gpus_per_worker == 8 and k3.state["bytes_per_token"] == 24 * 576
    assert any("ASSUMED" in n for n in k3.source["notes"])


def test_plain_cost_model_files_still_load(tmp_path):
    p = tmp_path / "plain.json"
    p.write_text(json.dumps({"decode_base_s": 0.03}))
    assert cost_profile(str(p)).decode_base_s == 0.03


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"format": "disagg-sim-profile/1", "name": "x", "source": {"kind": "guess"}}, "source.kind"),
        ({"format": "disagg-sim-profile/1", "name": "x", "source": {"kind": "measured"}}, "no prefill points"),
        ({"format": "disagg-sim-profile/9", "name": "x"}, "format"),
        ({"format": "disagg-sim-profile/1", "name": "x", "source": {"kind": "published"}, "speed": 1}, "unknown fields"),
        ({"format": "disagg-sim-profile/1", "name": "x", "source": {"kind": "published"},
          "prefill": [{"new_tokens": 0, "context": 0, "seconds": 1}]}, r"prefill\[0\]"),
        ({"format": "disagg-sim-profile/1", "name": "x", "source": {"kind": "published"},
          "transfer": {"nvlink": {"gbps": 1}}}, "unknown tier"),
    ],
)
def test_bad_profiles_name_the_problem(tmp_path, doc, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        load_profile(p)


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="no profile"):
        cost_profile("no-such-profile")
