"""The parts of the vLLM 0.33 K3 state connector that do not import vLLM.

```
geometry.py        vLLM KV cache groups -> StateLayout, group roles, block index arithmetic
jobs.py            LoadJob / SaveJob (scheduler -> workers), WorkerReport, StateHandle (P/D params)
stores.py          tiers from kv_connector_extra_config; StateStore per (writer DCP size, peer)
scheduler_side.py  lookups, load plans, finish / boundary / partial-tail saves, block pins
worker_side.py     cache views, batched scatter on load, layer-wise gather on save, puts
events.py          StoreEvent <-> vLLM BlockStored / BlockRemoved (take_events)
```

The connector class itself (it subclasses vLLM's base classes) lives in
``kv_transfer.vllm_connector``, the module vLLM loads through
``kv_connector_module_path``. See docs/vllm.md.
"""
