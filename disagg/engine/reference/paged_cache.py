"""Paged MLA latent cache and KDA state slots, sized from a byte budget.

    MLA cache, per MLA layer:  [num_blocks, block_size, latent_dim]
    KDA slots, per KDA layer:  conv [num_slots, conv_width - 1, 3*H*K]
                               recurrent [num_slots, H, K, V]

A request owns a block table (list of block ids, position t lives in block
table[t // bs] at row t % bs) and one KDA slot while it runs.

Single-token steps of sequences in one cache mix as one batch (``DecodeBatch``):

    tables [B, nb]   block tables padded with block 0 to the longest context
    keys   [B, nb*bs] rows gathered through the tables; ``masked`` hides each
                     sequence's rows past its new token (and the padding)

NOTES
1. A block id is either free or owned by exactly one request / resident
   session; ``BlockAllocator`` asserts both directions.
2. Block tables are append-only while a request runs.
3. The byte budget is split: KDA slots for ``max_num_seqs`` sequences first,
   the rest to MLA blocks. A request needing more blocks than exist is refused
   at admission with a ValueError.
4. A kept KDA state (a checkpoint: a prompt's end, a turn's end, a periodic or
   requested point) lives in pages of the MLA pool, ``checkpoint_pages`` of them
   (its bytes over a page's, rounded up: 6-85 for the presets, 85 for
   kimi-linear-48b in bf16; the simulator's default profile charges 54), as
   vLLM's hybrid allocator pages Mamba state beside attention. So the budget
   bounds everything a device keeps, resident sessions' checkpoints included,
   and a checkpoint competes for room as the simulator charges it. The state's
   bytes (conv, then recurrent from a 16-byte boundary) fill the pages' rows of
   every layer in turn (``save_state``, one index copy of 8-byte words). Rows no
   sequence owns are read and masked (a decode batch pads its tables with block
   0; a sequence's last page past its position), and a masked weight of 0 times
   a NaN bit pattern of state bytes is NaN: so a page given back is zeroed
   (``drop_state``), and block 0 never holds a state (the engine's allocation,
   engine NOTE 10).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from disagg.engine.reference.layers import TokenSpan
from kv_transfer.objects import StateLayout


class BlockAllocator:
    """Free list of block ids with ownership checks."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, "need at least one block"
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def is_free(self, block: int) -> bool:
        return not self._used[block]

    def allocate(self, n: int) -> list[int]:
        assert self.can_allocate(n), f"asked for {n} blocks, {len(self._free)} free"
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            assert not self._used[b], f"block {b} handed out twice"
            self._used[b] = True
        return out

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._used[b], f"block {b} freed twice"
            self._used[b] = False
            self._free.append(b)


@dataclass(slots=True)
class CacheGeometry:
    """How many blocks and slots a budget buys."""

    num_blocks: int  # MLA blocks
    num_slots: int  # KDA state slots
    block_bytes: int  # MLA bytes per block (all layers)
    slot_bytes: int  # KDA bytes per slot (all layers)

    @property
    def checkpoint_pages(self) -> int:
        """MLA pages one kept KDA state takes (NOTE 4; 0: the model keeps no KDA state, or has no pages)."""
        if not (self.slot_bytes and self.block_bytes):
            return 0
        return -(-(self.slot_bytes + 16) // self.block_bytes)  # 16: the recurrent bytes start aligned


def size_cache(layout: StateLayout, budget_bytes: int, max_num_seqs: int) -> CacheGeometry:
    """Split ``budget_bytes`` into KDA slots and MLA blocks (NOTE 3)."""
    block_bytes = layout.mla_block_bytes()
    slot_bytes = layout.kda_checkpoint_bytes()
    kda_bytes = slot_bytes * max_num_seqs
    if kda_bytes + block_bytes > budget_bytes:
        raise ValueError(
            f"cache budget {budget_bytes} B is too small: {max_num_seqs} KDA slots need "
            f"{kda_bytes} B and one MLA block {block_bytes} B"
        )
    num_blocks = (budget_bytes - kda_bytes) // max(block_bytes, 1)
    return CacheGeometry(num_blocks, max_num_seqs, block_bytes, slot_bytes)


class PagedStateCache:
    """The engine's device-resident state: paged MLA latents + KDA slots."""

    def __init__(self, layout: StateLayout, geometry: CacheGeometry, device: str | torch.device = "cpu"):
        self.layout = layout
        self.geometry = geometry
        bs, d = layout.block_size, layout.latent_dim
        cdt = getattr(torch, layout.cache_dtype)
        h, k, v, w = layout.kda_heads, layout.head_k, layout.head_v, layout.conv_width
        # one tensor per kind, stacked over layers (batched copies gather all layers in one kernel);
        # the per-layer lists are views of it
        self.mla_all = torch.zeros(layout.num_mla_layers, geometry.num_blocks, bs, d, dtype=cdt, device=device)
        self.conv_all = torch.zeros(layout.num_kda_layers, geometry.num_slots, w - 1, 3 * h * k,
                                    dtype=getattr(torch, layout.conv_dtype), device=device)
        self.rec_all = torch.zeros(layout.num_kda_layers, geometry.num_slots, h, k, v,
                                   dtype=getattr(torch, layout.state_dtype), device=device)
        self.mla = list(self.mla_all.unbind(0))
        # the pool's pages as 8-byte words where a page's layer rows allow (an index copy moves words, not
        # bytes: x6 faster on a CPU), [layers, blocks, words per layer's page] (NOTE 4)
        page = self.mla_all.view(torch.uint8).view(layout.num_mla_layers, geometry.num_blocks, -1)
        self._page_words = page.view(torch.int64) if page.shape[2] % 8 == 0 else page
        conv_n = self.conv_all[:, 0].numel() * self.conv_all.element_size()
        rec_at = -(-conv_n // 16) * 16  # the recurrent bytes start aligned
        self._state_split = (conv_n, rec_at, rec_at + self.rec_all[:, 0].numel() * self.rec_all.element_size())
        self.conv = list(self.conv_all.unbind(0))
        self.rec = list(self.rec_all.unbind(0))
        self.blocks = BlockAllocator(geometry.num_blocks)
        self._free_slots = list(range(geometry.num_slots - 1, -1, -1))
        # graph runner -> its whole-step decode graphs bound to these pools (graphs NOTE 6)
        self.decode_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- slots ---------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate_slot(self) -> int:
        assert self._free_slots, "no free KDA slot"
        slot = self._free_slots.pop()
        for c, r in zip(self.conv, self.rec, strict=True):
            c[slot].zero_()
            r[slot].zero_()
        return slot

    def free_slot(self, slot: int) -> None:
        assert slot not in self._free_slots, f"slot {slot} freed twice"
        self._free_slots.append(slot)

    # -- kept KDA states (NOTE 4) ---------------------------------------------------
    def save_state(self, conv: torch.Tensor, rec: torch.Tensor, pages: list[int]) -> None:
        """Write a KDA state, (conv, recurrent) stacked over layers (``conv_all[:, slot]``, ...), into
        ``pages``."""
        w = self._page_words
        buf = torch.empty(w.shape[0], len(pages), w.shape[2], dtype=w.dtype, device=w.device)
        flat = buf.view(torch.uint8).view(-1)
        conv_n, rec_at, end = self._state_split
        flat[conv_n:rec_at].zero_()  # the pages' bytes are all defined
        flat[end:].zero_()
        conv_v, rec_v = self._state_views(buf)
        conv_v.copy_(conv)
        rec_v.copy_(rec)
        w.index_copy_(1, self._index(pages), buf)

    def read_state(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The KDA state ``save_state`` wrote to ``pages``: (conv, recurrent), stacked over layers, as new
        tensors on the cache's device."""
        w, idx = self._page_words, self._index(pages)
        # one gather kernel on a GPU; on a CPU index_select runs x6 slower than indexing does
        return self._state_views(w.index_select(1, idx) if w.is_cuda else w[:, idx])

    def load_state(self, pages: list[int], slot: int) -> None:
        conv, rec = self.read_state(pages)
        self.conv_all[:, slot].copy_(conv)
        self.rec_all[:, slot].copy_(rec)

    def drop_state(self, pages: list[int]) -> None:
        """Zero ``pages`` and give them back to the pool (NOTE 4)."""
        self._page_words.index_fill_(1, self._index(pages), 0)
        self.blocks.free(pages)

    def _index(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.long).to(self._page_words.device, non_blocking=True)

    def _state_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = buf.view(torch.uint8).view(-1)
        conv_n, rec_at, end = self._state_split
        c, r = self.conv_all, self.rec_all
        assert end <= flat.numel(), "a kept state needs more pages than it was given"
        return (flat[:conv_n].view(c.dtype).view(c.shape[0], *c.shape[2:]),
                flat[rec_at:end].view(r.dtype).view(r.shape[0], *r.shape[2:]))

    # -- positions -------------------------------------------------------------
    def row_index(self, block_table: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat row ids (block * bs + offset) of positions [start, stop)."""
        bs = self.layout.block_size
        pos = torch.arange(start, stop)
        table = torch.as_tensor(block_table, dtype=torch.long)
        return table[pos // bs] * bs + pos % bs

    def read_rows(self, mla_idx: int, block_table: list[int], start: int, stop: int) -> torch.Tensor:
        flat = self.mla[mla_idx].view(-1, self.layout.latent_dim)
        if stop - start == 0:
            return flat[:0]
        bs = self.layout.block_size
        if start % bs == 0:  # whole blocks then a partial one: one gather per block run
            first, last = start // bs, (stop + bs - 1) // bs
            rows = self.mla[mla_idx][block_table[first:last]].reshape(-1, self.layout.latent_dim)
            return rows[: stop - start]
        return flat[self.row_index(block_table, start, stop)]

    def write_rows(self, mla_idx: int, block_table: list[int], start: int, rows: torch.Tensor) -> None:
        flat = self.mla[mla_idx].view(-1, self.layout.latent_dim)
        flat[self.row_index(block_table, start, start + rows.shape[0])] = rows.to(flat.dtype)


class PagedSeqCache:
    """``SequenceCache`` view of one request over a ``PagedStateCache``."""

    __slots__ = ("cache", "block_table", "slot", "start_pos")

    def __init__(self, cache: PagedStateCache, block_table: list[int], slot: int, start_pos: int):
        self.cache = cache
        self.block_table = block_table
        self.slot = slot
        self.start_pos = start_pos

    def mla_history(self, mla_idx: int) -> torch.Tensor:
        return self.cache.read_rows(mla_idx, self.block_table, 0, self.start_pos)

    def mla_append(self, mla_idx: int, rows: torch.Tensor) -> None:
        self.cache.write_rows(mla_idx, self.block_table, self.start_pos, rows)

    def kda_state(self, kda_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.conv[kda_idx][self.slot], self.cache.rec[kda_idx][self.slot]

    def kda_update(self, kda_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.cache.conv[kda_idx][self.slot].copy_(conv)
        self.cache.rec[kda_idx][self.slot].copy_(recurrent)


@dataclass(slots=True)
class DecodeBatch:
    """The step's single-token sequences over one ``PagedStateCache``, mixed as one batch.

    Layers write each new token's MLA row at ``write_at`` and then attend over
    ``cache.mla[i][tables]`` with ``masked`` keys hidden; KDA reads and writes the
    rows ``slots`` of the slot pools. Equal to the per-sequence path up to rounding
    (the same arithmetic, reduced over padded lengths).
    """

    cache: PagedStateCache
    rows: torch.Tensor  # [B] rows of these tokens in the step's token matrix
    slots: torch.Tensor  # [B] KDA slots
    write_at: torch.Tensor  # [B] flat MLA row (block * bs + offset) of each new token
    tables: torch.Tensor  # [B, nb] padded block tables
    masked: torch.Tensor  # [B, nb * bs] True for keys a sequence must not see

    @property
    def size(self) -> int:
        return int(self.rows.numel())

    @classmethod
    def split(cls, spans: list[TokenSpan]) -> tuple[DecodeBatch | None, list[TokenSpan]]:
        """(batch of the paged single-token spans, the spans left for the per-sequence path)."""
        batched = [sp for sp in spans if sp.num_tokens == 1 and isinstance(sp.cache, PagedSeqCache)]
        if batched:
            owner = batched[0].cache.cache
            batched = [sp for sp in batched if sp.cache.cache is owner]
        if not batched:
            return None, spans
        taken = {id(sp) for sp in batched}
        rest = [sp for sp in spans if id(sp) not in taken]
        bs = owner.layout.block_size
        nb = max(sp.start_pos // bs + 1 for sp in batched)
        tables = torch.zeros(len(batched), nb, dtype=torch.long)
        for i, sp in enumerate(batched):
            used = sp.start_pos // bs + 1
            tables[i, :used] = torch.as_tensor(sp.cache.block_table[:used], dtype=torch.long)
        pos = torch.tensor([sp.start_pos for sp in batched], dtype=torch.long)
        write_at = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1) * bs + pos % bs
        masked = torch.arange(nb * bs).unsqueeze(0) > pos.unsqueeze(1)
        device = owner.mla_all.device
        to = lambda t: t.to(device, non_blocking=True)
        batch = cls(owner, to(torch.tensor([sp.offset for sp in batched], dtype=torch.long)),
                    to(torch.tensor([sp.cache.slot for sp in batched], dtype=torch.long)),
                    to(write_at), to(tables), to(masked))
        return batch, rest
