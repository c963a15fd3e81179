"""/metrics merges the replicas' stats: the spill to the pool (``transfer.spill``) and the host
tiers once a node however many of its replicas report them, summed over nodes; replica counters summed."""

from __future__ import annotations

from disagg.api.metrics import ServingMetrics, merge_replica_stats


def _node(node: str, spilled: int, dropped: int = 0) -> dict:
    return {"node_id": node, "num_offered": spilled + dropped, "num_spilled": spilled, "num_refused": 1,
            "num_dropped": dropped, "num_no_target": 0, "bytes_spilled": spilled * 1000}


def _exported(stats: dict, *lines: str) -> None:
    """/metrics, fed the merged ``stats``, shows each of ``lines``."""
    metrics = ServingMetrics()
    metrics.observe_stats(stats)
    text = metrics.render()[0].decode()
    for line in lines:
        assert line in text, line


def test_each_nodes_spill_counts_once():
    replicas = [{"role": "decode", "spill": _node("n1", 5, 2)}, {"role": "decode", "spill": _node("n1", 5, 2)},
                {"role": "decode", "spill": _node("n2", 3)}, {"role": "prefill", "spill": None},
                {"role": "prefill"}]
    stats = merge_replica_stats(replicas)
    assert stats["spill"] == {"num_spilled": 8, "num_refused": 2, "num_dropped": 2, "num_no_target": 0,
                              "bytes_spilled": 8000}
    _exported(stats, 'disagg_spill_objects{outcome="spilled"} 8.0', 'disagg_spill_objects{outcome="dropped"} 2.0',
              "disagg_spill_bytes 8000.0")
    assert "spill" not in merge_replica_stats([{"role": "decode"}]), "no spill reported: none merged"


def _replica(role: str, node: str, host_used: int, corrupt: int = 0, running: int = 0) -> dict:
    """A replica's stats (``DecodeServer.stats``): its node, its node's host tier, its own counters."""
    host = {"used_bytes": host_used, "capacity_bytes": 1000, "num_objects": host_used // 100, "num_evictions": 1}
    return {"role": role, "node_id": node, "engine": {"running": running},
            "store": {"tier:host": host, "num_corrupt_pieces": corrupt}}


def test_node_tiers_count_once_a_node_and_replica_counters_add_up():
    """The ingress asks every replica (``deployments.ingress``): a node's host tier, which each of
    its replicas reports, counts once and the nodes add up; each replica's own counters (checksum
    failures on its loads, its engine's requests) add up over the replicas."""
    replicas = [_replica("decode", "n1", 300, corrupt=1, running=2), _replica("decode", "n1", 300, running=1),
                _replica("prefill", "n1", 300, corrupt=2), _replica("decode", "n2", 500, running=4)]
    stats = merge_replica_stats(replicas)
    assert stats["tiers"]["host"] == {"used_bytes": 800, "capacity_bytes": 2000, "num_objects": 8,
                                      "num_evictions": 2, "evictions": 2}
    assert stats["checksum_failures"] == 3
    assert stats["engines"]["decode"]["running"] == 7
    _exported(stats, 'disagg_tier_used_bytes{tier="host"} 800.0', 'disagg_tier_capacity_bytes{tier="host"} 2000.0',
              "disagg_checksum_failures 3.0")
