"""A router change measured against stored baselines: ``--reuse-baselines`` and ``ab_verdicts.py``.

The held-out and Mooncake-family scripts can run the state-aware router alone
and take the baselines' rows from an earlier run. With the router unchanged
that must give what the full run gave, row for row; with another router
config only the router's row may change. ``benchmarks/ab_verdicts.py`` then
reads either script's directory (and the suite's) and names the cells gained
and lost.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.sim.test_pd_itl_oracle import BENCH

# a router config the CLI accepts that places differently from the default: the prefix scorer alone
GREEDY = json.dumps({"profiles": {"both": {"filters": ["healthy", "role"], "scorers": {"prefix": 1.0}}}})


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import ab_verdicts
    import heldout_shapes
    import mooncake_shapes

    return heldout_shapes, mooncake_shapes, ab_verdicts


def test_heldout_reuse_gives_the_full_runs_rows(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    held, _, ab = bench
    monkeypatch.setitem(held.SHAPES, "rush", dataclasses.replace(held.SHAPES["rush"], sessions=10, turns=(2, 4)))
    cli = ["--shapes", "rush", "--modes", "agg,pd"]
    assert held.main(["--out", str(tmp_path / "full"), *cli]) == 0
    assert held.main(["--out", str(tmp_path / "same"), *cli, "--reuse-baselines", str(tmp_path / "full")]) == 0
    for cell in ("rush_agg", "rush_pd"):
        full = json.loads((tmp_path / "full" / f"{cell}.json").read_text())
        same = json.loads((tmp_path / "same" / f"{cell}.json").read_text())
        assert [r["policy"] for r in same] == [r["policy"] for r in full]
        assert [{k: v for k, v in r.items() if k != "wall_s"} for r in same] == \
            [{k: v for k, v in r.items() if k != "wall_s"} for r in full]
    capsys.readouterr()
    assert ab.main([str(tmp_path / "full"), str(tmp_path / "same")]) == 0
    text = capsys.readouterr().out
    assert "gained: none" in text and "lost: none" in text and "rush/agg" not in text  # nothing moved

    assert held.main(["--out", str(tmp_path / "greedy"), *cli, "--router-config", GREEDY,
                      "--reuse-baselines", str(tmp_path / "full")]) == 0
    full = json.loads((tmp_path / "full" / "rush_agg.json").read_text())
    greedy = json.loads((tmp_path / "greedy" / "rush_agg.json").read_text())
    assert greedy[1:] == full[1:] and greedy[0]["policy"] == "state_aware"
    assert greedy[0]["hit_rate"] > full[0]["hit_rate"]  # load ignored: sessions pile where prefixes are
    capsys.readouterr()
    assert ab.main([str(tmp_path / "full"), str(tmp_path / "greedy")]) == 0
    assert "rush/agg" in capsys.readouterr().out  # its figures moved, so the cell is printed

    import standing  # a run's P/D cells alone (``DIR:pd``), beside its aggregated ones from another run

    both = standing.standing([standing.run_spec(f"r={tmp_path / 'full'}")], by_mode=True)
    pd = standing.standing([standing.run_spec(f"r={tmp_path / 'full'}:pd"),
                            standing.run_spec(f"r={tmp_path / 'greedy'}:agg")], by_mode=True)
    assert "| r agg | " in both and "| r P/D | " in both
    assert [line.split(" | ")[0] for line in pd.splitlines() if line.startswith("| r ")] == ["| r P/D", "| r agg"]
    one = standing.standing([standing.run_spec(f"r={tmp_path / 'full'}:agg"),
                             standing.run_spec(f"r={tmp_path / 'full'}:pd")])  # one name: one row, both cells
    rows = [line.split(" | ") for line in one.splitlines() if line.startswith("| r ")]
    assert len(rows) == 1 and rows[0][1].endswith(" of 2")


def test_heldout_split_policies_gives_the_full_runs_rows_and_goes_on_where_it_stopped(
        bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--split-policies``: a process per policy gives the rows ``--policy all`` gives (but for
    wall time), each kept as it ends; a row already kept is taken, not run again."""
    held, _, _ = bench
    monkeypatch.setitem(held.SHAPES, "rush", dataclasses.replace(held.SHAPES["rush"], sessions=10, turns=(2, 4)))
    cli = ["--shapes", "rush", "--modes", "agg"]
    assert held.main(["--out", str(tmp_path / "full"), *cli]) == 0
    split = tmp_path / "split"
    assert held.main(["--out", str(split), *cli, "--split-policies", "--jobs", "2"]) == 0

    def rows(d: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in json.loads((d / "rush_agg.json").read_text())]

    assert rows(split) == rows(tmp_path / "full")
    kept = sorted(p.name for p in (split / "rows").iterdir())
    assert len(kept) == len(rows(split)) and "rush_agg.state_aware.json" in kept
    marked = json.loads((split / "rows" / "rush_agg.round_robin.json").read_text()) | {"wall_s": -1.0}
    (split / "rows" / "rush_agg.round_robin.json").write_text(json.dumps(marked))
    assert held.main(["--out", str(split), *cli, "--split-policies"]) == 0
    again = json.loads((split / "rush_agg.json").read_text())
    assert [r["wall_s"] for r in again if r["policy"] == "round_robin"] == [-1.0], "taken, not run again"


def test_mooncake_reuse_gives_the_full_runs_rows(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, mc, ab = bench
    cli = ["--seeds", "32", "--clusters", "agg16", "--modes", "open"]  # 86 requests
    assert mc.main(["--out", str(tmp_path / "full"), *cli]) == 0
    assert mc.main(["--out", str(tmp_path / "same"), *cli, "--reuse-baselines", str(tmp_path / "full"),
                    "--jobs", "2"]) == 0

    def runs(name: str) -> dict[str, dict]:
        rows = [json.loads(x) for x in (tmp_path / name / "runs.jsonl").read_text().splitlines()]
        return {r["policy"]: {k: v for k, v in r.items() if k != "wall_s"} for r in rows}

    assert runs("same") == runs("full")
    assert json.loads((tmp_path / "same" / "verdicts.json").read_text()) == \
        json.loads((tmp_path / "full" / "verdicts.json").read_text())
    capsys.readouterr()
    assert ab.main([str(tmp_path / "full"), str(tmp_path / "same"), "--all"]) == 0
    assert "32/agg16/open" in capsys.readouterr().out


def _cell(tmp: Path, passed: bool, ttft: float, inter: float) -> Path:
    """A router suite output directory of one cell (what ``ab_verdicts`` reads of it)."""
    tmp.mkdir()
    v = {"ttft_p90": 1.2, "interactivity_p90": 1.01 if passed else 0.99, "tokens_per_s_per_gpu": 1.0,
         "hit_vs_bound": 0.97, "pass": passed}
    row = {"ttft_p90": ttft, "interactivity_p90": inter, "tokens_per_s_per_gpu": 1000.0, "hit_vs_bound": 0.97}
    (tmp / "suite.json").write_text(json.dumps({"cells": {"m/16/pd": {"verdict": v, "rows": {"state_aware": row, "round_robin": row}}}}))
    return tmp


def test_ab_names_cells_gained_and_lost_and_which_way_each_figure_moved(bench, tmp_path: Path) -> None:
    _, _, ab = bench
    a = ab.load(_cell(tmp_path / "a", False, 2.0, 100.0))
    b = ab.load(_cell(tmp_path / "b", True, 2.5, 101.0))
    text = ab.compare(a, b)
    assert "missed -> met" in text and "gained: m/16/pd" in text and "lost: none" in text
    assert "TTFT P90 s 0 / 1" in text and "P90 tok/s/user 1 / 0" in text  # TTFT rose: worse
    assert "lost: m/16/pd" in ab.compare(b, a)
    with pytest.raises(SystemExit):
        ab.load(tmp_path)  # not a benchmark's output


def _rows(**figures: tuple[float, float, float]) -> dict[str, dict]:
    """policy -> (TTFT P90, P90 interactivity, tok/s/GPU), hit/bound 0.97."""
    return {p: {"ttft_p50": t, "ttft_p90": t, "interactivity_p90": i, "tokens_per_s_per_gpu": g, "hit_vs_bound": 0.97}
            for p, (t, i, g) in figures.items()}


def test_standing_sorts_each_miss_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import standing
    from router_suite import verdict

    def kinds(rows: dict[str, dict]) -> list[tuple[str, str]]:
        return [(key, kind) for key, kind, _ in standing.misses(verdict(rows), rows)]

    # ahead on interactivity only by serving a tenth of our tokens: the closed loop's trade
    assert kinds(_rows(state_aware=(0.2, 117.0, 6000.0), prefix_affinity=(40.0, 118.0, 600.0),
                       dynamo_cost=(1.0, 116.0, 5400.0))) == [("interactivity_p90", "served less")]
    # a baseline that serves as much is ahead too: lost, not explained by the trade
    assert kinds(_rows(state_aware=(0.2, 117.0, 6000.0), prefix_affinity=(40.0, 118.0, 600.0),
                       dynamo_cost=(1.0, 117.5, 6000.0))) == [("interactivity_p90", "lost")]
    assert kinds(_rows(state_aware=(0.2, 117.0, 6000.0), round_robin=(0.3, 117.05, 6000.0))) == \
        [("interactivity_p90", "tie")]
    assert kinds(_rows(state_aware=(0.5, 117.0, 6000.0), dynamo_cost=(0.4, 116.0, 6100.0))) == \
        [("ttft_p90", "lost"), ("tokens_per_s_per_gpu", "lost")]
    rows = _rows(state_aware=(0.2, 117.0, 6000.0), round_robin=(0.3, 116.0, 5000.0))
    rows["state_aware"]["hit_vs_bound"] = 0.948
    assert kinds(rows) == [("hit_vs_bound", "hit line")]
    rows["state_aware"]["hit_vs_bound"] = 0.94
    assert kinds(rows) == [("hit_vs_bound", "lost")]
    assert kinds(_rows(state_aware=(0.2, 117.0, 6000.0), round_robin=(0.3, 116.0, 5000.0))) == []


def test_standing_tells_pd_cells_from_aggregated_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import standing

    assert [standing.mode_of(x) for x in ("fanout/16/pd", "issue/pd", "issue+1000/64/pd", "3/pd16/open")] == ["P/D"] * 4
    assert [standing.mode_of(x) for x in ("fanout/16/agg", "issue/agg", "3/agg64/closed")] == ["agg"] * 3
    assert standing.run_spec("suite +0=results/a:pd") == ("suite +0", Path("results/a"), "P/D")
    assert standing.run_spec("results/a:agg") == ("results/a", Path("results/a"), "agg")
    assert standing.run_spec("x=results/a") == ("x", Path("results/a"), "")
    assert standing.run_spec("x=results/a:b") == ("x", Path("results/a:b"), ""), "not a mode: part of the path"


def test_router_suite_resume_goes_on_where_a_run_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``router_suite.py --resume``: the runs an earlier run into the same ``--out`` left are taken,
    a line a stop cut short is run again, and the state-aware router's run only under the same
    config (a baseline's does not depend on it)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import router_suite

    out = tmp_path / "suite"
    cli = ["--out", str(out), "--members", "chat_burst", "--workers", "16", "--modes", "agg",
           "--policies", "state_aware,round_robin"]
    assert router_suite.main(cli) == 0
    full = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["policy"] for r in full) == ["round_robin", "state_aware"]
    first, second = full
    (out / "runs.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(second)[:40])  # stopped mid-line
    ran: list[str] = []
    inner = router_suite.run_one

    def counted(task):
        ran.append(task[1])
        return inner(task)

    monkeypatch.setattr(router_suite, "run_one", counted)
    assert router_suite.main([*cli, "--resume"]) == 0
    assert ran == [second["policy"]], "only the run the stop cut short"
    again = {r["policy"]: r for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    assert {k: v for k, v in again[second["policy"]].items() if k != "wall_s"} == \
        {k: v for k, v in second.items() if k != "wall_s"}
    ran.clear()
    assert router_suite.main([*cli, "--resume", "--router-config", GREEDY]) == 0
    assert ran == ["state_aware"], "another config: the router runs again, the baseline is kept"
    capsys.readouterr()
