"""The router's expectation of a request's output tokens (``disagg.router.outputs``, router step 0)."""

import pytest

from disagg.router.context import EffectiveLoad, RoutingContext
from disagg.router.index import MatchResult, PrefixIndex
from disagg.router.outputs import OutputPredictor
from disagg.router.router import StateAwareRouter
from disagg.router.scorers.decode import DecodeScorer
from disagg.router.types import RouteRequest, WorkerState
from disagg.session import session_key


def test_a_clients_own_figure_wins_under_its_cap():
    p = OutputPredictor()
    assert p.expect("s", hint=300) == 300.0
    assert p.expect("s", hint=300, cap=200) == 200.0


def test_nothing_learned_is_unknown_and_a_cap_alone_is_not_an_expectation():
    p = OutputPredictor()
    assert p.expect("s") == 0.0
    assert p.expect("s", cap=4096) == 0.0  # max_tokens bounds an expectation, it is not one


def test_a_session_is_expected_to_answer_as_its_turns_did_and_a_new_one_as_the_cluster():
    p = OutputPredictor(session_alpha=0.5, global_alpha=0.5)
    p.book("a1", "A")
    p.learn("a1", 100)
    p.book("b1", "B")
    p.learn("b1", 900)
    assert p.expect("A") == 100.0
    assert p.expect("B") == 900.0
    assert p.expect("new") == 500.0  # the cluster's mean: 100, then halfway to 900
    p.book("a2", "A")
    p.learn("a2", 300)
    assert p.expect("A") == 200.0  # halfway from 100 to 300
    assert p.expect("A", cap=150) == 150.0
    assert p.expect("", cap=0) == p.expect("new")  # no session: the cluster's


def test_a_request_without_a_result_or_never_booked_teaches_nothing():
    p = OutputPredictor()
    p.book("r1", "A")
    p.learn("r1", None)  # abandoned
    p.learn("r1", 50)  # its booking went with it
    p.learn("stranger", 50)
    assert p.finished == 0
    assert p.expect("A") == 0.0


def test_tables_are_bounded():
    p = OutputPredictor(max_entries=2)
    for i in range(3):
        p.book(f"r{i}", f"s{i}")
    p.learn("r0", 10)  # its booking was the oldest: gone
    assert p.finished == 0
    for i in (1, 2):
        p.learn(f"r{i}", 10 * i)
    p.book("r3", "s3")
    p.learn("r3", 30)
    assert p.expect("s1") == p.expect("new")  # s1, the oldest session, was dropped
    assert p.expect("s3") == 30.0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        OutputPredictor(session_alpha=0)
    with pytest.raises(ValueError):
        OutputPredictor(global_alpha=1.5)
    with pytest.raises(ValueError):
        OutputPredictor(max_entries=0)


def _workers() -> list[WorkerState]:
    return [WorkerState(f"w{i}", "both", "n0", running_decode_requests=4 * i, running_decode_tokens=4000 * i)
            for i in range(2)]


def test_the_router_learns_a_sessions_outputs_from_finished_requests_and_its_decode_scorer_uses_them():
    router = StateAwareRouter(PrefixIndex())
    key = session_key("", "s")
    first = RouteRequest("r1", "s", [], 512, 64, max_output_tokens=4096)
    router.on_routed(first, router.route(first, _workers()))
    router.on_finished("r1", 0, 700)
    assert router.outputs.expect(key, cap=4096) == 700.0
    abandoned = RouteRequest("r2", "s", [], 512, 64)
    router.on_routed(abandoned, router.route(abandoned, _workers()))
    router.on_finished("r2", None, 5)  # no result: not an answer of the session's
    assert router.outputs.expect(key) == 700.0

    seen = []
    scorer = next(s for s, _ in router.profiles["both"].scorers if s.name == "decode")
    costs = scorer.costs

    def spy(ctx, workers):
        seen.append(ctx.expected_output)
        return costs(ctx, workers)

    scorer.costs = spy
    router.route(RouteRequest("r3", "s", [], 512, 64, max_output_tokens=4096), _workers())
    router.route(RouteRequest("r4", "s", [], 512, 64, max_output_tokens=300), _workers())
    router.route(RouteRequest("r5", "s", [], 512, 64, output_len_hint=20), _workers())
    assert seen == [700.0, 300.0, 20.0]


def test_the_decode_scorers_output_is_the_routers_expectation_then_the_hint_then_its_default():
    scorer = DecodeScorer()
    ws = [WorkerState("a"), WorkerState("b")]
    req = RouteRequest("r", "s", [], 512, 64, output_len_hint=50)

    def scale(expected: float, r: RouteRequest) -> float:
        ctx = RoutingContext(r, MatchResult({}, 0), {"a": EffectiveLoad(), "b": EffectiveLoad()}, "both",
                             expected_output=expected)
        return scorer.costs(ctx, ws)[1] - max(r.prompt_len, 0) / scorer.config.prefill_tokens_per_s

    step = scale(1.0, req)  # one token's decode step on the faster worker
    assert scale(400.0, req) == pytest.approx(400 * step)
    assert scale(0.0, req) == pytest.approx(50 * step)
    assert scale(0.0, RouteRequest("r", "s", [], 512, 64)) == pytest.approx(256 * step)
