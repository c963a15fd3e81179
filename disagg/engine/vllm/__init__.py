"""vLLM 0.33 backend: ``AsyncLLM`` + the K3 state connector, behind the same deployments.

```
options.py   engine.vllm options -> vLLM AsyncEngineArgs (connector, roles, per-role overrides)
engine.py    VLLMEngine: the engine protocol over AsyncLLM (token streaming, abort, health)
worker.py    VLLMWorker: disagg.flow over vLLM (ConnectorState: hand-off via kv_transfer_params)
```

vLLM is imported only when an engine is built (``vllm`` extra). See docs/vllm.md.
"""

from __future__ import annotations

from disagg.config import AppConfig


def lookup_store(app: AppConfig, tiers: list):
    """A presence-only ``StateStore`` over the node's tiers, in the decode engines' key space.

    The worker asks it for resumable lengths (conditional disaggregation); bytes
    are read by vLLM's connector, never through it.
    """
    from disagg.engine.vllm.options import model_id, parallel_sizes
    from kv_transfer.objects import StateLayout
    from kv_transfer.store import StateStore

    tp, dcp = parallel_sizes(app, "decode")
    # lookups read keys only: block size, TP shards and DCP shards decide them (not tensor shapes)
    layout = StateLayout(model_id(app), app.engine.block_size, 0, 1, 0, tp, 1, 1, 1)
    return StateStore(tiers, layout, tp_size=tp, dcp_size=dcp, write_behind=False)


def build_vllm_worker(app: AppConfig, role: str, host_socket: str | None, replica_id: str, node_id: str):
    """(engine, lookup store, worker) of one Serve replica running vLLM."""
    from disagg.engine.vllm.engine import VLLMEngine
    from disagg.engine.vllm.options import parallel_sizes
    from disagg.engine.vllm.worker import VLLMWorker

    engine = VLLMEngine(app, role, host_socket)
    lookup = None
    if role == "decode" and host_socket:
        from kv_transfer.tiers.host_ipc import HostTierClient

        lookup = lookup_store(app, [HostTierClient(host_socket)])
    worker = VLLMWorker(engine, lookup, replica_id, node_id, app.router.local_prefill_max_tokens,
                        producer_sizes=parallel_sizes(app, "prefill"), decider=app.router.decider_params())
    return engine, lookup, worker
