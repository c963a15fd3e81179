"""``benchmarks/mooncake_shapes.py``: random agentic shapes as Mooncake-format traces.

The traces must be what a Mooncake trace is (timestamps in order, one hash id
per 512-token block, compaction within the cap, system prompts shared across
sessions), the same for a seed, readable by the simulator's importer, and the
script's cell must be the CLI's own runs with the suite's verdict.
"""

from __future__ import annotations

import json

import pytest

from disagg.router.baselines import BASELINES
from disagg.tools.sim.workload import from_mooncake_records
from tests.sim.test_pd_itl_oracle import BENCH


@pytest.fixture
def mc(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import mooncake_shapes

    return mooncake_shapes


@pytest.mark.parametrize("seed", [1, 11, 29])
def test_a_trace_is_a_mooncake_trace_of_its_shape(mc, seed):
    shape, records = mc.trace(seed)
    assert (shape, records) == mc.trace(seed)  # a pure function of the seed
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    for r in records:
        assert -(-r["input_length"] // mc.BLOCK) == len(r["hash_ids"]) <= shape["cap"]
        assert shape["output"][0] <= r["output_length"] <= shape["output"][1]
    if shape["shared"]:  # every prompt starts with one of the system prompts
        heads = {tuple(r["hash_ids"][: shape["shared"]]) for r in records}
        assert 1 <= len(heads) <= shape["prompts"]
    reqs = from_mooncake_records(records, block_size=mc.BLOCK)
    assert len(reqs) == len(records)


def test_a_cell_is_the_clis_runs_and_the_suites_verdict(mc, tmp_path):
    _, records = mc.trace(32)  # 86 requests
    path = tmp_path / "32.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = mc.run_cell(path, "agg16", "open")
    assert set(rows) == {"state_aware", *BASELINES}
    assert all(r["requests"] == len(records) for r in rows.values())
    v = mc.verdict({"state_aware": rows.pop("state_aware"), **rows})
    assert set(v) >= {"ttft_p90", "interactivity_p90", "tokens_per_s_per_gpu", "hit_vs_bound", "pass"}
    assert mc._seeds("1-3,7") == [1, 2, 3, 7]


def test_a_cell_passes_the_router_config_to_the_cli(mc, tmp_path):
    """``--router-config`` reaches ``disagg sim run``: a config it rejects fails the cell."""
    import subprocess

    _, records = mc.trace(32)
    path = tmp_path / "32.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(subprocess.CalledProcessError) as err:
        mc.run_cell(path, "agg16", "open", ["--router-config", '{"no_such_key": 1}'])
    assert "no_such_key" in err.value.stderr


def test_traces_runs_the_users_own_files(mc, tmp_path):
    """``--traces``: cells of the files given, labelled by stem, nothing generated; a missing file is
    a usage error."""
    _, records = mc.trace(32)
    mine = tmp_path / "in" / "mine.jsonl"
    mine.parent.mkdir()
    mine.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert mc.main(["--out", str(out), "--traces", str(mine), "--clusters", "agg16", "--modes", "open"]) == 0
    verdicts = json.loads((out / "verdicts.json").read_text())
    assert list(verdicts) == ["mine/agg16/open"]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert {r["policy"] for r in runs} == {"state_aware", *BASELINES}
    assert all(r["cell"] == "mine/agg16/open" and r["requests"] == len(records) for r in runs)
    assert sorted(p.name for p in out.iterdir()) == ["runs.jsonl", "verdicts.json"]  # no seed traces written
    with pytest.raises(SystemExit):
        mc.main(["--out", str(out), "--traces", str(tmp_path / "none.jsonl")])
