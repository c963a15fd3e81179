"""disagg: disaggregated prefill/decode serving of Kimi-K3-class hybrid models.

The package, lowest layer first (``tools/check_imports.py`` keeps imports pointing down):

    config, messages, session, faults, console     typed config, wire messages, identities
    engine/        the engine protocol, the reference K3 engine, the vLLM engine
    router/        placement: index, scorers, the P/D decider, the policy
    reuse/         reuse accounting and checkpoint placement
    flow           the decode-side request flow, written once
    workers/       the flow bound to an engine and a state path (tiered, vllm)
    api/           the OpenAI-compatible HTTP app
    tools/         offline: bench, sim, plan
    launch/        the ``disagg`` command and what starts the system

The Ray Serve application is the top-level ``deployments`` package; state transfer is
``kv_transfer``.
"""
