"""Session state in the simulated tiers: object keys, checkpoints, resume and store.

Objects and their tier keys (bytes, see ``disagg.tools.sim.cache``)::

    MLA block i          d_i                  16-byte chained digest, 1 unit
    KDA checkpoint at    b"K" + d_i           aligned position p = (i + 1) * bs
    checkpoint + tail    b"T" + t             unaligned p, t = tail_digest(d_{p // bs}, p % bs)

A checkpoint takes ``ckpt_units`` units (its bytes over one block's bytes).
Every insert and eviction becomes an index update of the router's
``PrefixIndex`` (a "T" object is both the MLA tail and the KDA checkpoint at
its digest), so the router sees exactly the simulated caches (with live
stats, the index *is* the ground truth).

Checkpoint policy (where a prefill leaves resume points)::

    every_blocks      p = k * every * bs                  periodic (0: off)
    last_full_block   p = floor(plen / bs) * bs           the last full block (unaligned prompts only)
    prompt_end        p = plen                            aligned or with a tail

The reference engine keeps prompt-end checkpoints (``prompt_end``) and,
with ``checkpoint_interval``, periodic ones; ``last_full_block`` is the
aligned approximation of a prompt end the simulator used first.

Resume on worker w (device tier of w, host and disk tiers of w's node)::

    n    = leading blocks readable from some tier
    p    = furthest checkpoint position <= n * bs, p < plen (aligned keys or tail probes)
    load = blocks before p not on the device, and the checkpoint, by tier:
           bytes / bandwidth + latency per tier

NOTES
1. A resume never reads past the first block no tier holds.
2. Resumed blocks and the checkpoint are copied into the device tier (reads
   from host or disk are copies: the slower tier keeps its object).
3. Host evictions go to the node's disk tier when there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import gt, or_
from typing import TYPE_CHECKING

from disagg.costs.model import CostModel
from disagg.router.types import TailProbe
from disagg.tools.sim.cache import LRUTier, NodeView
from disagg.tools.sim.workload import tail_digest

if TYPE_CHECKING:
    from disagg.router.index import PrefixIndex

TIER_NAMES = ("device", "host", "disk")
_K = b"K"
_T = b"T"


@dataclass(slots=True)
class CheckpointPolicy:
    every_blocks: int = 16  # periodic checkpoints every this many blocks (0: off)
    last_full_block: bool = True  # aligned checkpoint at the prompt's last full block before its end
    prompt_end: bool = False  # checkpoint at the prompt end (with an MLA tail when unaligned)
    learned: bool = False  # serving's learned placement too (``disagg.reuse.placement``; Simulator NOTE 5)

    def __post_init__(self) -> None:
        if self.every_blocks < 0:
            raise ValueError("every_blocks must be >= 0")


@dataclass(slots=True)
class PromptState:
    """What the state model needs of one prompt."""

    digests: list[bytes]  # chained digests of all ceil(plen / bs) blocks (the last may be partial)
    prompt_len: int  # tokens
    block_size: int  # tokens per block
    probes: list[tuple[int, bytes]]  # unaligned resume points to try: (position, tail digest)

    @property
    def num_full(self) -> int:
        return self.prompt_len // self.block_size

    def full(self) -> list[bytes]:
        return self.digests[: self.num_full]

    def tail_probes(self) -> list[TailProbe]:
        return [TailProbe(p, t) for p, t in self.probes]


@dataclass(slots=True)
class Resume:
    """Outcome of a resume: position, slowest tier, load seconds."""

    tokens: int = 0  # resumed tokens (0: nothing)
    tier: str | None = None  # slowest tier read
    load_s: float = 0.0  # transfer time into the device
    nbytes: float = 0.0  # bytes transferred
    key: bytes | None = None  # the checkpoint resumed from ("K" or "T" key; None: nothing)


def checkpoint_units(cost: CostModel, block_size: int) -> int:
    """Blocks' worth of tier space one KDA checkpoint takes (at least 1)."""
    block_bytes = block_size * cost.bytes_per_token
    return max(1, round(cost.checkpoint_bytes / block_bytes)) if block_bytes else 1


class StateModel:
    """Tier keys, checkpoint placement, resume and store for one simulated cluster."""

    def __init__(self, cost: CostModel, policy: CheckpointPolicy, block_size: int, index: PrefixIndex):
        self.cost = cost
        self.policy = policy
        self.block_size = block_size
        self.index = index
        self.block_bytes = block_size * cost.bytes_per_token
        self.ckpt_units = checkpoint_units(cost, block_size)
        self.num_events = 0

    def size_of(self, key: Hashable) -> int:
        """A tier key's size in blocks: an MLA block's (its 16-byte digest) 1, a checkpoint's more."""
        return 1 if len(key) == 16 else self.ckpt_units  # type: ignore[arg-type]

    # ---- index publication -------------------------------------------------------
    def listener(self, tier: str, reporter: str, spill: LRUTier | None = None, demoted_too: bool = True
                 ) -> Callable[[str, Hashable], None]:
        """Tier event callback: index updates (and host -> disk spill, NOTE 3; with ``demoted_too``
        False, demoted objects are not spilled: the spill to the pool, Simulator NOTE 4).

        Each event is the index's ``apply_update`` of ``IndexUpdate(op, kind, digest, tier,
        reporter)``, through its per-producer hot path (``PrefixIndex.updater``).
        """
        update = self.index.updater(tier, reporter)
        units = self.ckpt_units

        def on_event(op: str, key: Hashable) -> None:
            assert isinstance(key, bytes)
            stored = op == "stored"  # else "evicted" or "evicted_demoted" (cache NOTE 4)
            if len(key) == 16:
                update(stored, "mla", key)
                self.num_events += 1
            elif key[:1] == _K:
                update(stored, "kda", key[1:])
                self.num_events += 1
            else:
                digest = key[1:]
                update(stored, "tail", digest)
                update(stored, "kda", digest)
                self.num_events += 2
            if spill is not None and not stored and (demoted_too or op == "evicted"):  # cache NOTE 4
                spill.put(key, 1 if len(key) == 16 else units)  # ``size_of``, inline

        return on_event

    # ---- checkpoints ---------------------------------------------------------------
    def checkpoint_keys(self, ps: PromptState, from_pos: int, extra: Sequence[int] = ()) -> list[bytes]:
        """Keys of the checkpoints a prefill from ``from_pos`` to the prompt end leaves: the policy's,
        and one at each block boundary of ``extra`` in ``(from_pos, plen)`` (a learned placement's)."""
        bs, plen, pol = self.block_size, ps.prompt_len, self.policy
        d = ps.digests
        nbs = {p // bs for p in extra if from_pos < p < plen and p % bs == 0}
        if pol.every_blocks:
            step = pol.every_blocks
            first = (from_pos // bs) // step * step + step  # first multiple of step blocks past from_pos
            nbs.update(range(first, (plen - 1) // bs + 1, step))
        if pol.last_full_block:
            nb = plen // bs
            if nb and from_pos < nb * bs < plen:
                nbs.add(nb)
        keys = [_K + d[nb - 1] for nb in sorted(nbs)]  # ascending positions: the newest last
        if pol.prompt_end and plen > from_pos:
            nb, off = divmod(plen, bs)
            if off:
                keys.append(_T + tail_digest(d[nb], off))
            elif nb not in nbs:
                keys.append(_K + d[nb - 1])
        return keys

    def prompt_end_key(self, ps: PromptState) -> tuple[int, bytes] | None:
        """(position, tail digest) of the prompt end, when it is unaligned (a resume probe later)."""
        nb, off = divmod(ps.prompt_len, self.block_size)
        if off == 0:
            return None
        return ps.prompt_len, tail_digest(ps.digests[nb], off)

    # ---- resume ----------------------------------------------------------------------
    def resume(self, ps: PromptState, device: LRUTier, host: LRUTier | None, disk: LRUTier | None,
               remote: bool = False, dry: bool = False) -> Resume:
        """Resume ``ps`` on ``device`` from it and the node tiers ``host`` / ``disk``.

        ``remote``: those tiers are another node's (a peer read): their host objects come over
        the remote link. ``dry``: measure only, copy nothing into ``device``.
        """
        bs, plen = self.block_size, ps.prompt_len
        full = ps.full()
        tiers = [t for t in (device, host, disk) if t is not None]
        flags = [t.present(full) for t in tiers]
        readable = flags[0] if len(flags) == 1 else list(map(or_, *flags[:2])) if len(flags) == 2 else \
            list(map(or_, map(or_, flags[0], flags[1]), flags[2]))
        try:
            n = readable.index(False)
        except ValueError:
            n = len(readable)
        best_p, best_key, best_blocks = 0, None, 0
        for p, t in ps.probes:  # unaligned points: blocks before p // bs plus the tail object
            k = p // bs
            if best_p < p < plen and k <= n:
                key = _T + t
                if any(key in tier for tier in tiers):
                    best_p, best_key, best_blocks = p, key, k
        limit = min(n, (plen - 1) // bs)
        for i in range(limit - 1, -1, -1):  # aligned points, furthest first
            if (i + 1) * bs <= best_p:
                break
            key = _K + full[i]
            if any(key in tier for tier in tiers):
                best_p, best_key, best_blocks = (i + 1) * bs, key, i + 1
                break
        if best_key is None:
            return Resume()
        m = best_blocks
        on_dev = flags[0][:m]
        slowest = 0
        nbytes_tier = [0.0, 0.0, 0.0]
        missing = m - sum(on_dev)
        mates = isinstance(host, NodeView)  # Simulator NOTE 12: a mate writes back what the host tier lacks
        recalled = 0.0
        if missing:
            if host is not None:
                on_host = flags[1][:m]
                from_host = sum(map(gt, on_host, on_dev))  # on the host, not on the device (bools)
                if from_host and mates:  # on a mate's device only
                    own = host.host.present(full[:m]) if host.host is not None else [False] * m
                    recalled = sum(map(gt, on_host, map(or_, own, on_dev))) * self.block_bytes
            else:
                from_host = 0
            from_disk = missing - from_host
            nbytes_tier[1] = from_host * self.block_bytes
            nbytes_tier[2] = from_disk * self.block_bytes
            slowest = 2 if from_disk else 1
        ck_tier = next(i for i, t in ((0, device), (1, host), (2, disk)) if t is not None and best_key in t)
        if ck_tier:
            nbytes_tier[ck_tier] += self.cost.checkpoint_bytes
            slowest = max(slowest, ck_tier)
            if ck_tier == 1 and mates and (host.host is None or best_key not in host.host):
                recalled += self.cost.checkpoint_bytes
        names = ("device", "remote", "disk") if remote else TIER_NAMES
        load_s = sum(self.cost.transfer_time(nb, names[i]) for i, nb in enumerate(nbytes_tier) if nb)
        if recalled:  # written back into the mate's node's host tier first, then read
            load_s += self.cost.transfer_time(recalled, "host")
        if dry:
            return Resume(best_p, names[slowest], load_s, sum(nbytes_tier), best_key)
        read = [k for k, on in zip(full[:m], on_dev, strict=True) if not on]  # what the device lacked
        if ck_tier:
            read.append(best_key)
        for tier in tiers[1:]:  # a read refreshes a policy tier (cache.PolicyTier), as serving's does
            tier.read(read)
        device.put_many(full[:m])
        device.put(best_key, self.ckpt_units)
        return Resume(best_p, names[slowest], load_s, sum(nbytes_tier), best_key)

    # ---- store -------------------------------------------------------------------------
    def store_chunk(self, ps: PromptState, upto: int, device: LRUTier) -> list[bytes]:
        """A running prefill's computed part, up to ``upto`` (a block boundary): its blocks and the
        checkpoint at ``upto``, on ``device`` only (an engine's prefix cache: Simulator NOTE 11).
        Returns the blocks' keys."""
        nb = upto // self.block_size
        assert nb * self.block_size == upto, "a chunk ends on a block boundary"
        blocks = ps.full()[:nb]
        if blocks:
            device.put_many(blocks)
            device.put(_K + blocks[-1], self.ckpt_units)
        return blocks

    def store(self, ps: PromptState, from_pos: int, device: LRUTier, host: LRUTier | None,
              ckpts: list[bytes] | None = None, extra: Sequence[int] = ()) -> list[bytes]:
        """The prompt's blocks and checkpoints after a prefill from ``from_pos``: device, write-through host.

        Returns the checkpoint keys (so a decode worker receiving the state stores the same ones).
        """
        full = ps.full()
        keys = self.checkpoint_keys(ps, from_pos, extra) if ckpts is None else ckpts
        device.put_many(full)
        for k in keys:
            device.put(k, self.ckpt_units)
        if host is not None:
            host.put_many(full)
            for k in keys:
                host.put(k, self.ckpt_units)
        return keys
