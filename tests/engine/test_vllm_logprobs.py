"""The vLLM backend's logprobs, mapped to ``TokenLogprob`` (``disagg.engine.vllm.engine._logprobs``).

No vLLM here: its output objects are stood in for at the boundary (a completion output's
``logprobs``: one ``{token_id: Logprob(logprob, rank)}`` per new token, the sampled token and
the ``k`` likeliest, as vLLM 0.33 returns them with ``RequestOutputKind.DELTA``).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

from disagg.engine.protocol import TokenLogprob
from disagg.engine.vllm.engine import _logprobs


def _lp(logprob: float, rank: int) -> NS:
    return NS(logprob=logprob, rank=rank, decoded_token=None)


def test_sampled_token_and_its_alternatives_likeliest_first():
    comp = NS(logprobs=[{7: _lp(-0.5, 2), 3: _lp(-0.2, 1), 9: _lp(-1.5, 3)},  # sampled 7: the second likeliest
                        {4: _lp(-0.1, 1), 5: _lp(-2.0, 2)}])
    got = _logprobs(comp, [7, 4], 2)
    assert got == [TokenLogprob(-0.5, [(3, -0.2), (7, -0.5)]), TokenLogprob(-0.1, [(4, -0.1), (5, -2.0)])]


def test_only_the_sampled_token_when_no_alternatives_are_asked():
    comp = NS(logprobs=[{7: _lp(-0.5, 2), 3: _lp(-0.2, 1)}])
    assert _logprobs(comp, [7], 0) == [TokenLogprob(-0.5, [])]


def test_nothing_when_not_asked_or_nothing_new():
    comp = NS(logprobs=[{7: _lp(-0.5, 1)}])
    assert _logprobs(comp, [7], None) is None
    assert _logprobs(comp, [], 2) is None
    assert _logprobs(None, [7], 2) is None
