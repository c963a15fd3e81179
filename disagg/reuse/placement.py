"""Checkpoint placement: where a keep_state prefill keeps extra KDA checkpoints.

Resume needs MLA blocks *and* a KDA checkpoint at the same position. The
engine keeps one at the prompt end and at its last full block
(``disagg.engine.reference.engine`` NOTE 5); three more kinds of point pay:

1. **Where this workload's next turns diverge.** An agent's next prompt drops
   the previous prompt's ephemeral tail (reminders, a rewritten tool result),
   so it diverges a few blocks before the previous prompt's end, not inside
   its partial last block. Each follow-up shows how many blocks back from its
   predecessor's last full block it diverged (``observe``); a decayed
   histogram of those distances (bounded: at most ``max_blocks_back`` bins; a
   follow-up that kept less than half of its predecessor, a compaction or a
   rewrite, is not learned) picks up to ``max_points + 1`` of them at its
   quantiles up to ``coverage`` (NOTE 3), and each prefill keeps a checkpoint
   there (``positions``)::

       prompt k     |....|....|....|eph.|eph.|e|      last full block: A
       prompt k+1   |....|....|....|new context.......   diverged at A - 2 blocks
       -> later prompts also keep a checkpoint 2 blocks before their A

2. **Prefixes shared across sessions** (a system prompt): the ledger reports
   the block boundary where a prompt stops sharing another session's blocks
   (``branch``); a checkpoint there lets every later session's first turn
   resume at the shared prefix.

3. **A cold-start prior**, for what nothing has shown yet:

   - *Back*: until ``prior_mass`` follow-ups were learned, prompts also keep
     checkpoints ``prior_back`` blocks back from their last full block (1, 2,
     4: geometric, so a tail of up to 4 blocks resumes within half of its
     distance), fewer as observations arrive (the first
     ``ceil(len(prior_back) * (1 - observed / prior_mass))`` of them). A
     workload whose follow-ups extend the whole prompt teaches distance 0,
     and the prior goes without leaving a point.
   - *Start*: in the part of a prompt no earlier prompt shared (past the
     ledger's bound, ``seen``), checkpoints at ``2^k`` blocks from the prompt
     start, the ``start_points`` largest. A prefix that a later prompt turns
     out to share (another session's first turn before any branch point
     existed, a compaction back to the system prompt) resumes at the largest
     power-of-two boundary inside it: at least half of it, when it is longer
     than the smallest point kept. In steady state a prompt's unseen part is
     its new tail, which rarely spans a power of two: ~0 points.

Bound (NOTE 1): at most ``max_extra`` extra checkpoints per prompt, taken in
the order branch, learned, back prior, start prior. With the engine's two a
prefill keeps at most ``max_extra + 2`` KDA states. Each extra one costs one
KDA state (the MLA blocks are shared with the prompt's own): for K3, 69 KDA
layers x (recurrent 32 heads x 128 x 128 fp32 = 2 MiB + conv 3 x 3 x 4096
bf16 = 72 KiB) ~ 143 MiB over the TP group (18 MiB per rank at TP8), about
10.9K tokens of K3's MLA history (24 layers x 576 B FP8 per token).

Config (``engine``-neutral; the worker owns one)::

    CheckpointPlacement(block_size=64, max_points=3, coverage=0.98,
                        prior_back=(1, 2, 4), prior_mass=4, start_points=3, max_extra=6)

NOTES
1. ``len(positions(...)) <= max_extra``; every position is a block boundary in
   ``(resume, num_prompt)`` other than the prompt's last full block.
2. ``positions`` is pure: the same histogram and arguments give the same points.
3. Quantiles, not the most frequent distances: a point at distance d serves every follow-up
   that diverges at most d blocks back (it resumes d - D blocks short of its divergence D).
   Agentic prompts end in tails of varying length (reminders, a tool result the next turn
   rewrites), so the distances spread over tens of blocks; the most frequent few cover a
   fraction of them, and a follow-up diverging past the furthest point kept falls back to an
   older turn's point (a whole turn recomputed). The quantiles keep one at the ``coverage``
   quantile, so all but ``1 - coverage`` of the follow-ups resume within one quantile gap;
   a distribution with one distance (a fixed tail, or 0: follow-ups extend the whole prompt)
   still gets exactly that one. Measured in docs/router.md, "Round 10".
4. One worker learns only from the follow-ups it serves whose predecessor it also served: a few
   dozen in a run of ``deep_context/16/agg`` (docs/router.md, "Round 11"), too few for quantiles,
   and each new worker a session lands on starts cold. The router sees every follow-up: it runs
   this class over all of them (``disagg.router.divergence``) and each decision carries the
   distances (``RouteDecision.checkpoint_back``), which the decode-side flow passes to
   ``positions(back=...)`` in place of its own. The worker's own stay the fallback (a router
   without sessions, a baseline router).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class CheckpointPlacement:
    """Learned checkpoint positions with a cold-start prior (see the module docstring)."""

    block_size: int
    max_points: int = 3  # extra checkpoints per prompt from the divergence histogram
    coverage: float = 0.98  # the furthest learned point: this quantile of the distances (NOTE 3)
    decay: float = 0.995  # weight kept by older observations at each new one
    max_blocks_back: int = 64  # distances beyond this (a rewrite, a compaction) are not learned
    prior_back: tuple[int, ...] = (1, 2, 4)  # cold start: blocks back from the last full block, nearest first
    prior_mass: float = 4.0  # observations after which the back prior is gone
    start_points: int = 3  # points at 2^k blocks from the start in a prompt's unseen part (largest first)
    max_extra: int = 6  # bound on the extra checkpoints of one prompt (NOTE 1)
    _weights: dict[int, float] = field(default_factory=dict)  # blocks back -> decayed count
    num_observed: int = 0  # follow-ups learned so far (the back prior blends out over them)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_points < 0 or not 0 < self.coverage <= 1:
            raise ValueError("need block_size > 0, max_points >= 0 and 0 < coverage <= 1")
        if any(b <= 0 for b in self.prior_back) or self.prior_mass < 0:
            raise ValueError("prior_back distances must be > 0 blocks and prior_mass >= 0")
        if self.start_points < 0 or self.max_extra < 0:
            raise ValueError("need start_points >= 0 and max_extra >= 0")

    def observe(self, prev_len: int, shared: int) -> None:
        """A follow-up shared ``shared`` tokens of its predecessor's ``prev_len``-token prompt.
        One that kept less than half of it (a compaction, a rewrite) says nothing of where the next
        follow-up drops its tail, and is not learned."""
        bs = self.block_size
        if not 0 <= shared <= prev_len or 2 * shared < prev_len:
            return
        back = (prev_len // bs) - (shared // bs)
        if not 0 <= back <= self.max_blocks_back:
            return
        for k in list(self._weights):
            self._weights[k] *= self.decay
            if self._weights[k] < 1e-3:
                del self._weights[k]
        self._weights[back] = self._weights.get(back, 0.0) + 1.0
        self.num_observed += 1

    def learned(self) -> list[int]:
        """Distances (blocks back from the last full block) that get a checkpoint: the quantiles of
        the learned distribution at ``coverage * i / (max_points + 1)``, i = 1.., so a follow-up that
        diverges anywhere up to the ``coverage`` quantile resumes at the nearest point at or past its
        divergence (NOTE 3); those serving the most mass first."""
        if not self._weights:
            return []
        k = self.max_points + 1
        items = sorted(self._weights.items())
        total = sum(w for _, w in items)
        levels = [self.coverage * total * (i + 1) / k for i in range(k)]
        chosen: list[tuple[int, float]] = []  # (distance, mass it serves: divergences since the last point)
        cum = served = 0.0
        level = 0
        for back, w in items:
            cum += w
            served += w
            if cum >= levels[level] * (1 - 1e-9):
                chosen.append((back, served))
                served = 0.0
                while level < k and cum >= levels[level] * (1 - 1e-9):
                    level += 1
                if level == k:
                    break
        return [b for b, _ in sorted(chosen, key=lambda x: (-x[1], x[0]))]

    def prior(self) -> list[int]:
        """The back prior's distances in use now: all of ``prior_back`` on a cold start, fewer as
        observations arrive, none from ``prior_mass`` on."""
        if self.prior_mass <= 0:
            return []
        left = max(0.0, 1.0 - self.num_observed / self.prior_mass)
        return list(self.prior_back[: math.ceil(len(self.prior_back) * left)])

    def distances(self) -> list[int]:
        """Blocks back from a prompt's last full block where it keeps checkpoints: the learned ones
        (``learned``, distance 0 is the engine's own), then the back prior's (``prior``)."""
        out = [b for b in self.learned() if b > 0]
        return out + [b for b in self.prior() if b not in out]

    def positions(self, num_prompt: int, resume: int = 0, branch: int = 0, seen: int = 0,
                  back: Sequence[int] | None = None) -> tuple[int, ...]:
        """Block boundaries in ``(resume, num_prompt)`` where this prompt's prefill keeps checkpoints,
        besides the engine's own (prompt end, last full block); at most ``max_extra`` (NOTE 1).
        The arguments are ``placed``'s."""
        return tuple(p for p, _ in self.placed(num_prompt, resume, branch, seen, back))

    def placed(self, num_prompt: int, resume: int = 0, branch: int = 0, seen: int = 0,
               back: Sequence[int] | None = None) -> tuple[tuple[int, str], ...]:
        """``positions`` with the rule that put each one there, as (position, kind), by position:
        kind "branch", "back" (a distance back from the last full block: learned, the router's or
        the back prior's) or "start" (the start prior); a point two rules ask for is the first's.

        Args:
            num_prompt: the prompt's tokens.
            resume: where its prefill resumes (points at or before it exist already).
            branch: where it stops sharing another session's blocks (0: nowhere).
            seen: the longest prefix an earlier prompt sent (the start prior places points past it).
            back: distances in blocks back from the last full block, ranked, in place of this
                placement's own ``distances()`` (NOTE 4: the router's, learned from every worker's
                follow-ups); None: its own.
        """
        bs = self.block_size
        last_full = num_prompt // bs * bs  # the engine keeps this one (or the prompt end, when aligned)

        def ok(p: int) -> bool:
            return resume < p < num_prompt and p != last_full

        ranked: list[tuple[int, str]] = [(branch // bs * bs, "branch")] if branch else []
        ranked += [(last_full - b * bs, "back") for b in (self.distances() if back is None else back) if b > 0]
        ranked += [(p, "start") for p in sorted((bs << k for k in range(max(1, num_prompt // bs).bit_length())
                                                 if (bs << k) > seen), reverse=True)[: self.start_points]]
        out: dict[int, str] = {}
        for p, kind in ranked:
            if ok(p) and p not in out:
                out[p] = kind
        return tuple(sorted(list(out.items())[: self.max_extra]))
