"""Checkpoint placement: where a keep_state prefill keeps extra KDA checkpoints.

Resume needs MLA blocks *and* a KDA checkpoint at the same position. The
engine keeps one at the prompt end and at its last full block
(``disagg.engine.reference.engine`` NOTE 5); two more kinds of point pay:

1. **Where this workload's next turns diverge.** An agent's next prompt drops
   the previous prompt's ephemeral tail (reminders, a rewritten tool result),
   so it diverges a few blocks before the previous prompt's end, not inside
   its partial last block. Each follow-up shows how many blocks back from its
   predecessor's last full block it diverged (``observe``); a decayed
   histogram of those distances (bounded: at most ``max_blocks_back`` bins; a
   follow-up that kept less than half of its predecessor, a compaction or a
   rewrite, is not learned) picks the ``max_points`` most frequent ones
   covering ``coverage`` of the mass, and each prefill keeps a checkpoint
   there (``positions``)::

       prompt k     |....|....|....|eph.|eph.|e|      last full block: A
       prompt k+1   |....|....|....|new context.......   diverged at A - 2 blocks
       -> later prompts also keep a checkpoint 2 blocks before their A

2. **Prefixes shared across sessions** (a system prompt): the ledger reports
   the block boundary where a prompt stops sharing another session's blocks
   (``branch``); a checkpoint there lets every later session's first turn
   resume at the shared prefix.

Config (``engine``-neutral; the worker owns one)::

    CheckpointPlacement(block_size=64, max_points=3, coverage=0.98)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CheckpointPlacement:
    """Learned checkpoint positions (see the module docstring)."""

    block_size: int
    max_points: int = 3  # extra checkpoints per prompt from the divergence histogram
    coverage: float = 0.98  # stop adding distances once this share of the mass is covered
    decay: float = 0.995  # weight kept by older observations at each new one
    max_blocks_back: int = 64  # distances beyond this (a rewrite, a compaction) are not learned
    _weights: dict[int, float] = field(default_factory=dict)  # blocks back -> decayed count

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_points < 0 or not 0 < self.coverage <= 1:
            raise ValueError("need block_size > 0, max_points >= 0 and 0 < coverage <= 1")

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

    def learned(self) -> list[int]:
        """Distances (blocks back from the last full block) that get a checkpoint, most frequent first."""
        total = sum(self._weights.values())
        out: list[int] = []
        covered = 0.0
        for back, w in sorted(self._weights.items(), key=lambda kv: (-kv[1], kv[0])):
            if covered >= self.coverage * total or len(out) >= self.max_points + 1:
                break
            out.append(back)
            covered += w
        return out

    def positions(self, num_prompt: int, resume: int = 0, branch: int = 0) -> tuple[int, ...]:
        """Block boundaries in ``(resume, num_prompt)`` where this prompt's prefill keeps checkpoints,
        besides the engine's own (prompt end, last full block)."""
        bs = self.block_size
        last_full = num_prompt // bs * bs  # the engine keeps this one (or the prompt end, when aligned)
        points = {last_full - back * bs for back in self.learned() if back > 0}
        if branch:
            points.add(branch // bs * bs)
        return tuple(sorted(p for p in points if resume < p < num_prompt and p > 0 and p != last_full))
