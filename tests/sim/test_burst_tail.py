"""``benchmarks/burst_tail.py``'s figures on hand-made records: the burst's share of the TTFT tail
and its balance over workers."""

from __future__ import annotations

import pytest

from disagg.tools.sim.metrics import RequestRecord
from tests.sim.test_pd_itl_oracle import BENCH


def _rec(i: int, worker: str, prompt: int, arrival: float, ttft: float) -> RequestRecord:
    return RequestRecord(f"r{i}", f"s{i}", 0, prompt, 8, arrival, decode_worker=worker, prefill_worker=worker,
                         first_token=arrival + ttft, finish=arrival + ttft + 1.0)


def test_the_tail_is_the_burst_and_its_balance_is_the_heaviest_worker_over_the_mean(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import burst_tail

    # a burst at t=0: w0 gets 3,000 prompt tokens, w1 1,000; then 18 later requests with short waits
    recs = [_rec(0, "w0", 1000, 0.0, 0.9), _rec(1, "w0", 2000, 0.0, 1.0), _rec(2, "w1", 1000, 0.0, 0.5)]
    recs += [_rec(3 + i, f"w{i % 2}", 500, 1.0 + i, 0.05) for i in range(17)]
    p90, p99, share, balance = burst_tail.figures(recs)
    assert p90 == pytest.approx(0.54)  # 20 requests: between the 18th (0.5) and 19th (0.9) waits
    assert p99 == pytest.approx(0.981)
    assert share == 1.0  # the requests at or past the P90 (0.9 and 1.0) both arrived in the burst
    assert balance == pytest.approx(3000 / 2000)
    recs[-1] = _rec(99, "w1", 500, 30.0, 2.0)  # one late request slower than the burst: the P90 is 0.91
    assert burst_tail.figures(recs)[2] == 0.5  # at or past it: the burst's 1.0 s and the late 2.0 s
