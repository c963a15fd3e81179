"""kv_transfer ``StoreEvent`` <-> vLLM KV cache events (``take_events``).

vLLM publishes what ``take_events`` returns in its ``KVEventBatch`` (ZMQ, when
``kv_events_config`` is set). Our objects map onto vLLM's event types so any
vLLM-aware consumer sees host/disk residency, and ``store_event_from_vllm``
turns them back into the ``StoreEvent`` the router's prefix index reads
(``disagg.router.index.update_from_event``):

    StoreEvent(stored|moved, key, kind, tier)  ->  BlockStored(block_hashes=[digest], medium, ownership=key)
    StoreEvent(evicted, key, kind, tier)       ->  BlockRemoved(block_hashes=[digest], medium, ownership=key)

    medium: host -> "CPU", disk -> "STORAGE", other tiers by name ("remote:<peer>")
    ownership: the full object key "mla:<digest>[:shard]" (kind and shard included)

The worker id is not carried: an event stream belongs to one engine, whose id
the subscriber knows.
"""

from __future__ import annotations

from kv_transfer.events import StoreEvent, object_kind_of

_MEDIUM = {"host": "CPU", "disk": "STORAGE"}
_TIER = {v: k for k, v in _MEDIUM.items()}


def to_vllm_events(events: list[StoreEvent], block_size: int) -> list:
    """vLLM ``BlockStored`` / ``BlockRemoved`` for our store events (vLLM imported here)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out = []
    for ev in events:
        parts = ev.key.split(":")
        if len(parts) < 2 or not object_kind_of(ev.key):
            continue
        digest = bytes.fromhex(parts[1])
        medium = _MEDIUM.get(ev.tier, ev.tier)
        if ev.kind == "evicted":
            out.append(BlockRemoved(block_hashes=[digest], medium=medium, ownership=ev.key))
        else:
            out.append(BlockStored(block_hashes=[digest], parent_block_hash=ev.parent, token_ids=[],
                                   block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                                   kv_cache_spec_kind=ev.object_kind, ownership=ev.key))
    return out


def store_event_from_vllm(event, worker_id: str) -> StoreEvent | None:
    """The ``StoreEvent`` behind one of our vLLM events; None for vLLM's own (GPU) events."""
    key = getattr(event, "ownership", None)
    if not key or not object_kind_of(key):
        return None
    tier = _TIER.get(event.medium, event.medium or "")
    kind = "evicted" if type(event).__name__ == "BlockRemoved" else "stored"
    return StoreEvent(kind, key, object_kind_of(key), tier, worker_id,
                      parent=getattr(event, "parent_block_hash", None))
