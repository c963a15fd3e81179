"""/metrics reports the spill to the pool (``transfer.spill``): each node's counters once, however
many of its replicas report them, summed over nodes."""

from __future__ import annotations

from disagg.api.metrics import ServingMetrics, merge_replica_stats


def _node(node: str, spilled: int, dropped: int = 0) -> dict:
    return {"node_id": node, "num_offered": spilled + dropped, "num_spilled": spilled, "num_refused": 1,
            "num_dropped": dropped, "num_no_target": 0, "bytes_spilled": spilled * 1000}


def test_each_nodes_spill_counts_once():
    replicas = [{"role": "decode", "spill": _node("n1", 5, 2)}, {"role": "decode", "spill": _node("n1", 5, 2)},
                {"role": "decode", "spill": _node("n2", 3)}, {"role": "prefill", "spill": None},
                {"role": "prefill"}]
    stats = merge_replica_stats(replicas)
    assert stats["spill"] == {"num_spilled": 8, "num_refused": 2, "num_dropped": 2, "num_no_target": 0,
                              "bytes_spilled": 8000}
    metrics = ServingMetrics()
    metrics.observe_stats(stats)
    text = metrics.render()[0].decode()
    for line in ('disagg_spill_objects{outcome="spilled"} 8.0', 'disagg_spill_objects{outcome="dropped"} 2.0',
                 "disagg_spill_bytes 8000.0"):
        assert line in text, line
    assert "spill" not in merge_replica_stats([{"role": "decode"}]), "no spill reported: none merged"
