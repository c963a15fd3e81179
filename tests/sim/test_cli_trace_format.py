"""`disagg sim run --trace` reads both trace formats and fails bad input in one line."""

from __future__ import annotations

import json

import pytest

from disagg.costs import cost_profile
from disagg.tools.bench.mooncake import trace_format
from disagg.tools.bench.trace import TraceError
from disagg.tools.sim import simulator
from disagg.tools.sim.cli import main as sim_main

# two sessions sharing a 2-block prefix; the second turn of each extends its first (64-token blocks)
MOONCAKE = [
    {"timestamp": 0, "input_length": 200, "output_length": 8, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 10, "input_length": 230, "output_length": 8, "hash_ids": [0, 1, 7, 8]},
    {"timestamp": 900, "input_length": 300, "output_length": 8, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 950, "input_length": 290, "output_length": 8, "hash_ids": [0, 1, 7, 8, 9]},
]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(trace: str, *extra: str) -> int:
    return sim_main(["sim", "run", "--trace", trace, "--workers", "2", "--concurrency", "2", "--json", *extra])


def test_a_mooncake_trace_is_detected_and_replayed(tmp_path, capsys):
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    assert trace_format(trace) == "mooncake"
    assert _run(trace, "--block-size", "64") == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["requests"] == 4
    assert row["hit_rate"] > 0  # the second turns resumed their sessions' first turns


def test_every_policy_reports_hit_against_the_capacity_bound(tmp_path, capsys):
    """Every row carries hit/bound. With room for everything and the CLI's learned checkpoint
    placement, the bound resumes at any block boundary and at an earlier prompt's end: each
    second turn at its predecessor's end (200 and 230 tokens), and nothing for the second session's
    first turn, which arrives while the first computes the prefix they share (blocks exist from
    their first token on). The state-aware router resumes exactly that."""
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    assert _run(trace, "--block-size", "64", "--policy", "all") == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["policy"] for r in rows][0] == "state_aware" and len(rows) == 5
    assert rows[0]["hit_vs_bound"] == 1.0
    assert rows[0]["hit_vs_theory"] < 1.0
    assert all(0.0 <= r["hit_vs_bound"] <= 1.0 for r in rows)
    assert _run(trace, "--block-size", "64", "--no-bound") == 0
    assert "hit_vs_bound" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_format_can_be_named(tmp_path, capsys):
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    assert _run(trace, "--block-size", "64", "--format", "mooncake") == 0
    assert _run(trace, "--block-size", "64", "--format", "disagg") == 2  # not what it says: one line
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("disagg sim: ") and "session_id" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_the_disagg_format_is_detected(tmp_path):
    row = {"session_id": "s0", "turn": 0, "timestamp": 0, "delay": 0, "input_length": 100,
           "output_length": 4, "hash_ids": [1, 2], "block_size": 64}
    trace = _write(tmp_path / "d.jsonl", [row])
    assert trace_format(trace) == "disagg"
    assert _run(trace, "--block-size", "64") == 0


@pytest.mark.parametrize(("rows", "message"), [
    ([], "trace is empty"),
    ([{"prompt": "hi"}], "neither a disagg trace line"),
])
def test_unknown_or_empty_traces_fail_in_one_line(tmp_path, capsys, rows, message):
    trace = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError, match=message):
        trace_format(trace)
    assert _run(trace) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_missing_file_fails_in_one_line(tmp_path, capsys):
    assert _run(str(tmp_path / "nope.jsonl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("disagg sim: ")


def test_router_config_reaches_the_state_aware_router_only(tmp_path, capsys):
    """``--router-config`` (JSON text or a YAML file) configures the state-aware router: by default
    these short prompts prefill on their decode worker; a decider with no local rule sends them
    all through the P/D pool. The baselines run as before."""
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    pd = ("--block-size", "64", "--prefill", "1", "--decode", "2", "--policy", "all")

    def runs(*extra: str) -> dict[str, dict]:
        assert _run(trace, *pd, *extra) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
        return {r["policy"]: r for r in rows}

    plain = runs()
    assert set(plain["state_aware"]["router"]["decisions"]) == {"local_short_suffix/cold", "local_short_suffix/cache_hit"}
    cfg = tmp_path / "router.yaml"
    cfg.write_text("decider: {local_prefill_max_tokens: 0, local_idle_margin: 0}\n")
    for text in (str(cfg), '{"decider": {"local_prefill_max_tokens": 0, "local_idle_margin": 0}}'):
        pool = runs("--router-config", text)
        assert set(pool["state_aware"]["router"]["decisions"]) == {"disagg/cold", "disagg/cache_hit"}
        assert pool["dynamo_cost"] == {**plain["dynamo_cost"], "wall_s": pool["dynamo_cost"]["wall_s"]}


@pytest.mark.parametrize("text, says", [('{"pending": true}', "unknown router config keys"),
                                        ('{"pending_ttl_s": 0}', "positive"), ("{", "--router-config"),
                                        ("missing.yaml", "No such file")])
def test_a_bad_router_config_fails_in_one_line(tmp_path, capsys, text, says):
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    assert _run(trace, "--block-size", "64", "--router-config", text) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_output_hint_says_what_the_router_is_told_of_outputs(tmp_path, capsys, monkeypatch):
    """``--output-hint none`` (the default) tells the routers nothing of a request's output, as a
    serving client's ``max_tokens`` tells them a cap at most, and the state-aware router learns
    from what finished (Simulator NOTE 9); ``exact`` hands them the trace's output lengths."""
    from disagg.router.router import StateAwareRouter

    rows = [dict(r, output_length=5 + 10 * i) for i, r in enumerate(MOONCAKE)]
    trace = _write(tmp_path / "mc.jsonl", rows)
    seen: list[int] = []
    learned: list[int] = []
    route, finished = StateAwareRouter.route, StateAwareRouter.on_finished

    def spy_route(self, request, workers, *args, **kw):
        seen.append(request.output_len_hint)
        return route(self, request, workers, *args, **kw)

    def spy_finished(self, request_id, cached, output_tokens=None, served=None):
        learned.append(output_tokens)
        finished(self, request_id, cached, output_tokens, served)

    monkeypatch.setattr(StateAwareRouter, "route", spy_route)
    monkeypatch.setattr(StateAwareRouter, "on_finished", spy_finished)
    assert _run(trace, "--block-size", "64") == 0
    assert seen == [0, 0, 0, 0]
    assert sorted(learned) == [5, 15, 25, 35]  # every finished request's output reached the router
    seen.clear()
    assert _run(trace, "--block-size", "64", "--output-hint", "exact") == 0
    assert sorted(seen) == [5, 15, 25, 35]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        _run(trace, "--output-hint", "max_tokens")
    assert exc.value.code == 2
    assert "--output-hint" in capsys.readouterr().err


def test_a_cluster_refuses_an_unknown_output_hint():
    from disagg.tools.sim.simulator import ClusterConfig

    with pytest.raises(ValueError, match="output_hint"):
        ClusterConfig(output_hint="oracle")


def test_stale_stats_tell_the_router_when_each_request_decoded_and_ended(tmp_path, monkeypatch):
    """With ``--stats-period`` the router reads stats copies, so each finished request comes with
    when its decode began and when it ended (``served``), which takes it off copies taken before
    its end (disagg.router.loads NOTE 6); with live stats (the default) it comes with none."""
    from disagg.router.router import StateAwareRouter

    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    served_seen: list = []
    finished = StateAwareRouter.on_finished

    def spy_finished(self, request_id, cached, output_tokens=None, served=None):
        served_seen.append(served)
        finished(self, request_id, cached, output_tokens, served)

    monkeypatch.setattr(StateAwareRouter, "on_finished", spy_finished)
    assert _run(trace, "--block-size", "64") == 0
    assert served_seen == [None] * len(MOONCAKE)
    served_seen.clear()
    assert _run(trace, "--block-size", "64", "--stats-period", "0.5") == 0
    assert len(served_seen) == len(MOONCAKE)
    assert all(s is not None and 0 < s[0] <= s[1] for s in served_seen)


def test_router_costs_say_what_the_router_prices_time_with(tmp_path, capsys, monkeypatch):
    """``--router-costs``: on the default engine profile, whose figures are the router's built-in
    constants, both choices place alike; on another engine ``engine`` (the default) lays that
    engine's cost model under the state-aware router's config and ``builtin`` lays none; a bad
    choice fails."""
    trace = _write(tmp_path / "mc.jsonl", MOONCAKE)
    priced: list[dict] = []
    real = simulator.with_engine_costs
    monkeypatch.setattr(simulator, "with_engine_costs", lambda config, cost: priced.append(cost) or real(config, cost))

    def row(*extra: str) -> dict:
        priced.clear()
        assert _run(trace, "--block-size", "64", *extra) == 0
        r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        r.pop("wall_s")
        return r

    assert row() == row("--router-costs", "builtin")
    assert row("--profile", "h200-small")["requests"] == 4
    assert priced == [cost_profile("h200-small").to_dict()], "the router got the simulated engine's figures"
    assert row("--profile", "h200-small", "--router-costs", "builtin")["requests"] == 4
    assert priced == [], "builtin: the router keeps its own constants"
    with pytest.raises(SystemExit):
        _run(trace, "--router-costs", "nope")
