"""``benchmarks/router_pareto.py``: every baseline operating point against the router's points across load.

The verdict's rules on hand-made points (what covers what, the 1% tolerance on
tok/s/GPU, the interpolated throughput at a baseline's interactivity, where the
next load is tried), then a small trace through the script itself: its points are
what ``disagg sim run`` reports at the same lanes, and its verdict is the rule
applied to them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.sim.test_pd_itl_oracle import BENCH, _trace


@pytest.fixture
def pareto(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import router_pareto

    return router_pareto


def _p(lanes: float, inter: float, tps: float, ttft: float = 1.0) -> dict:
    return {"lanes": lanes, "interactivity_p90": inter, "tokens_per_s_per_gpu": tps, "ttft_p90": ttft,
            "ttft_p50": ttft / 2}


def test_covers_needs_every_figure(pareto) -> None:
    b = _p(2, 100.0, 1000.0, 1.0)
    assert pareto.covers(_p(1, 100.0, 1000.0, 1.0), b)
    assert pareto.covers(_p(1, 100.0, 990.0, 1.0), b)  # tok/s/GPU within 1%
    assert not pareto.covers(_p(1, 100.0, 989.0, 1.0), b)
    assert not pareto.covers(_p(1, 99.9, 2000.0, 0.1), b)  # less interactive
    assert not pareto.covers(_p(1, 120.0, 2000.0, 1.01), b)  # slower first token


def test_verdict_lists_the_points_no_router_point_covers(pareto) -> None:
    ours = [_p(1, 120.0, 1000.0, 0.1), _p(2, 115.0, 2000.0, 0.2), _p(4, 110.0, 2500.0, 2.0)]
    points = {
        "state_aware": ours,
        "slow": [_p(2, 118.0, 900.0, 5.0), _p(4, 121.0, 300.0, 9.0)],  # the second is more interactive than ours
        "busy": [_p(4, 112.0, 1900.0, 3.0), _p(8, float("nan"), 1.0, 1.0)],  # NaN: not a point
    }
    v = pareto.cell_verdict(points)
    assert v["baseline_points"] == 3
    assert [(u["policy"], u["point"]["lanes"]) for u in v["uncovered"]] == [("slow", 4)]
    assert v["uncovered"][0]["nearest"] == ours[2]  # the most throughput among ours (none reaches 121)
    assert not v["pass"]
    # the worst ratio is the uncovered point's: no router point reaches its interactivity
    assert v["min_tps_at_equal_interactivity"] == 0.0
    del points["slow"][1]
    v = pareto.cell_verdict(points)
    assert v["pass"] and not v["uncovered"]
    # busy's (112, 1900) read on our front between (110, 2500) and (115, 2000), slow's (118, 900) at (118, ~1400)
    assert 2000 / 1900 < v["min_tps_at_equal_interactivity"] < 2500 / 1900
    assert not pareto.cell_verdict({"state_aware": ours, "slow": []})["pass"]  # nothing checked is no pass


def test_tps_at_reads_the_front_and_falls_back_below_it(pareto) -> None:
    ours = [_p(1, 120.0, 1000.0), _p(2, 110.0, 2000.0)]
    mid = pareto.tps_at(ours, 115.0)
    assert 1000.0 < mid < 2000.0
    assert pareto.tps_at(ours, 120.0) == pytest.approx(1000.0)
    assert pareto.tps_at(ours, 50.0) == 2000.0  # below the front: the best point at or above
    assert pareto.tps_at(ours, 130.0) is None


def test_refine_tries_the_load_between_the_bracketing_points(pareto) -> None:
    ours = [_p(1, 120.0, 1000.0), _p(2, 118.0, 2000.0), _p(4, 115.0, 2500.0)]
    unc = [{"point": _p(8, 116.0, 2400.0)}, {"point": _p(8, 116.5, 2450.0)}, {"point": _p(1, 125.0, 10.0)}]
    assert pareto.refine_lanes(ours, unc) == [3.0]  # both between 2 and 4; 125 is above every point
    assert pareto.refine_lanes([*ours, _p(3, 117.0, 2300.0)], unc) == [3.5]  # 3 measured: now 3..4


def test_trace_mode_runs_what_the_cli_runs(pareto, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import pd_itl

    trace = tmp_path / "t.jsonl"
    _trace(trace, sessions=8, turns=3)
    sim_args = "--block-size 64 --prefill 1 --decode 3"
    out = tmp_path / "out"
    assert pareto.main(["--trace", str(trace), "--sim-args", sim_args, "--lanes", "0.5", "1",
                        "--policies", "state_aware,round_robin", "--refine", "0", "--out", str(out)]) == 0
    doc = json.loads((out / "pareto.json").read_text())
    (label, cell), = doc["cells"].items()
    assert label.startswith("t (")
    pts = cell["points"]
    assert sorted(pts) == ["round_robin", "state_aware"]
    assert all(sorted(p["lanes"] for p in pts[k]) == [0.5, 1.0] for k in pts)
    # 4 engines: 0.5 lanes each is 2 lanes, as disagg sim run --concurrency 2 runs them
    direct = pd_itl.trace_sim(str(trace), [*sim_args.split(), "--concurrency", "2"], "round_robin", None).run().summary
    got = next(p for p in pts["round_robin"] if p["lanes"] == 0.5)
    for k in ("interactivity_p90", "tokens_per_s_per_gpu", "ttft_p90"):
        assert got[k] == pytest.approx(direct[k])
    v = cell["verdict"]
    expect = all(any(pareto.covers(s, b) for s in pts["state_aware"]) for b in pts["round_robin"])
    assert v["pass"] == expect and v["baseline_points"] == 2
    assert math.isfinite(v["min_tps_at_equal_interactivity"]) or not expect
    assert (out / "pareto.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert f"{int(expect)}/1 cells: every baseline point covered" in text
    assert "; 4 runs in" in text

    # a second run takes the baselines from the first and runs only the router
    again = tmp_path / "again"
    assert pareto.main(["--trace", str(trace), "--sim-args", sim_args, "--lanes", "0.5", "1",
                        "--policies", "state_aware,round_robin", "--refine", "0", "--out", str(again),
                        "--reuse-baselines", str(out)]) == 0
    assert "; 2 runs in" in capsys.readouterr().out
    pts2 = json.loads((again / "pareto.json").read_text())["cells"][label]["points"]
    assert pts2 == pts
    # another load is not the same run: it is run, not reused
    assert pareto.main(["--trace", str(trace), "--sim-args", sim_args, "--lanes", "0.75",
                        "--policies", "state_aware,round_robin", "--refine", "0", "--out", str(tmp_path / "x"),
                        "--reuse-baselines", str(out)]) == 0
    assert "; 2 runs in" in capsys.readouterr().out


def test_bad_arguments_are_refused(pareto) -> None:
    with pytest.raises(SystemExit):
        pareto.main(["--policies", "round_robin"])
    with pytest.raises(SystemExit):
        pareto.main(["--lanes", "0"])
    with pytest.raises(SystemExit):
        pareto.main(["--members", "nope"])
