"""State reuse accounting and checkpoint placement, over plain data.

    ledger     what this worker has seen and published (bounded digests): the
               infinite-cache bound of a prompt and the resume points it had
    misses     one reason for every prompt token computed below that bound
    placement  where a keep_state prefill keeps extra KDA checkpoints
    retention  which of a session's checkpoints the tiers evict first (superseded)

The worker (``disagg.workers.tiered``) calls these at a few marked points; nothing
here imports an engine, a store, Ray or HTTP.
"""
