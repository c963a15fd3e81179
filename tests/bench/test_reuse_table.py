"""The bench's miss-reason table, read from the server's reuse counters."""

from __future__ import annotations

from types import SimpleNamespace

from disagg.tools.bench.metrics import format_reuse
from disagg.tools.bench.servermetrics import reuse_delta
from disagg.tools.bench.sweep import reuse_table

BEFORE = """disagg_reuse_miss_tokens_total{reason="evicted"} 10.0
disagg_reuse_miss_tokens_total{reason="no_checkpoint"} 0.0
disagg_reuse_bound_tokens_total 100.0
"""
AFTER = """disagg_reuse_miss_tokens_total{reason="evicted"} 30.0
disagg_reuse_miss_tokens_total{reason="no_checkpoint"} 50.0
disagg_reuse_bound_tokens_total 900.0
"""


def test_delta_and_table_add_up():
    delta = reuse_delta(BEFORE, AFTER)
    assert delta == {"misses": {"evicted": 20.0, "no_checkpoint": 50.0}, "bound_tokens": 800.0}
    ok = lambda cached: SimpleNamespace(ok=True, prompt_tokens=600, input_length=600, cached_tokens=cached)  # noqa: E731
    output = SimpleNamespace(results=[ok(400), ok(310), SimpleNamespace(ok=False)], theoretical_tokens_all=820)
    table = reuse_table(delta, output)
    assert table["realized_tokens"] == 710 and table["prompt_tokens"] == 1200
    # 820 - 710 = 110 = 20 evicted + 50 no_checkpoint + 20 the client counts and the server never saw + 20 left
    assert table["misses"] == {"evicted": 20.0, "no_checkpoint": 50.0, "hash_mismatch": 20.0, "unattributed": 20.0}
    text = "\n".join(format_reuse(table))
    assert "no_checkpoint" in text and "0.866" in text


def test_no_counters_no_table():
    assert reuse_delta("x 1\n", "x 2\n") == {}
    assert reuse_delta(None, AFTER) == {}
    assert reuse_table({}, SimpleNamespace(results=[], theoretical_tokens_all=0)) == {}
