"""The serving workers: ``disagg.flow`` bound to an engine and a state path.

    tiered   StatefulWorker over the engine protocol (the reference engine); its state
             goes through ``kv_transfer``'s tiers (``TierState``)
    vllm     VLLMWorker over vLLM's AsyncLLM; its state goes through vLLM's K3
             connector (``ConnectorState``), built by ``build_vllm_worker``

Both are adapters: the decode-side flow is ``disagg.flow.RequestFlow``, written once.
"""
