"""The reference engine: continuous batching over the reference K3 model.

Each step packs decodes (one token each) and prefill chunks into one forward,
under ``max_num_batched_tokens``. Prefill chunks end on block boundaries (or at
the end of the tokens to compute), so a computation resumed at a block
boundary repeats exactly the arithmetic of an uninterrupted one:

    prompt     |--- bs ---|--- bs ---|--- bs ---|-- rest --|
    chunks      <------ chunk 1 ----><---- chunk 2 ------->   (budget 2*bs)

State a request can hand on (``export_state``): MLA blocks before p, the MLA
tail when p is not block-aligned, and the KDA state at p, for p = the current
position or a checkpoint taken at a block boundary (``checkpoint_interval``).

NOTES
1. A request owns its block table and KDA slot from admission until it
   finishes; a finished request with ``keep_state`` keeps its blocks (not its
   slot: its end state is copied out) until ``release``.
2. Released and finished requests become *resident sessions* (the device tier):
   their blocks and end state stay until memory is needed (LRU). A new request
   whose prompt extends a resident session's tokens adopts its state; one that
   resumes at less than half of a resident (a prefix shared across sessions,
   e.g. a system prompt) copies the pages it needs and leaves the resident to
   its own session's next turn. So does a prompt that does not go past the
   resident's tokens (it cannot be that session's next turn: n choices of one
   prompt, a retry), and one while another queued request resumes from the
   same resident too (subagents forked together): each copies, the last one
   queued adopts. Of equal matches the closest session wins.
3. ``num_computed <= len(token_ids) - 1`` after every step of a live request
   that has sampled: the newest sampled token is not yet computed.
4. A step launches hundreds of kernels from Python, so the stepping thread
   needs the GIL every few microseconds. With state publishing and loading
   threads in the same process, the default 5 ms GIL switch interval makes it
   wait in a convoy; an engine lowers the process's interval to 0.5 ms
   (``gil_switch_interval_s``, never raising it).
5. Aligned checkpoints: a prompt's end is rarely block-aligned, and a next
   prompt that shares its blocks but not its partial last block (an edited
   context, a synthetic trace keyed per block) can only resume where both MLA
   blocks and a KDA state exist: at a block boundary. So a ``keep_state``
   prefill stops its chunk at the prompt's last block boundary and keeps the
   KDA state there too (one slot copy; an uninterrupted run stops at the same
   place, so resumed arithmetic stays exact). A request admitted at such a point
   (resumed from a loaded state or a resident session) keeps it as well: it is
   where the next prompt on the same prefix resumes from this device.
6. Preemption (as vLLM's scheduler does it): running requests are planned
   oldest first, and one that cannot get its next blocks (after evicting
   resident sessions) preempts the newest running request, never one already
   planned, until it fits or is itself the newest; a preempted request frees
   everything and recomputes from the head of the queue. A step that preempted
   admits nothing new (the victims would take the blocks back at once). So the
   oldest request always progresses, prefills included, unless blocks held for
   export (``keep_state``, NOTE 1) leave too few: then it keeps what it has and
   waits, alone, for their ``release`` (``generate``, the engine alone, reports
   the stall; in a server the exporting worker releases them).
7. Requested checkpoints (``EngineRequest.checkpoint_at``): a ``keep_state``
   request also keeps the KDA state at each block boundary its caller names
   (where a worker's placement policy expects a later prompt to diverge:
   ``disagg.reuse.placement``). Chunks stop there as at NOTE 5's point, in any
   step, whatever else the step carries; the positions are checked at
   admission (block-aligned, inside the prompt).
8. Delta imports: a ``ResumeState`` with ``first_block`` k > 0 carries the MLA rows from
   block k on (and the tail and KDA state at its position); the rows before come from the
   resident session holding the most leading blocks of the prompt (``resident_blocks``, the
   caller's lookup before it loaded: a hand-off to the decode replica that decoded the
   session's last turn moves only the new turn's blocks). Those pages are copied or adopted as
   NOTE 2's. A base evicted between the lookup and the admission is no error: the request
   resumes what the device still holds and computes the rest (``delta_base_misses``).
9. Resident changes (``on_resident``, None by default): a caller that mirrors the device tier
   elsewhere (the node's host tier as the devices' victim cache: ``disagg.workers.holds``) is
   told, on the stepping thread, of each resident session kept (``kept``), taken back by a
   request (``taken``: its pages live on in that request, resident again when it is released)
   and evicted for memory (``evicted``, with ``export`` valid during the call only: the state
   at any of its checkpoints, gathered to host memory before its pages are freed). The hook
   runs inside a step, so it must be quick; one that raises is logged and the engine goes on.
10. Kept KDA states live in the MLA pool (``paged_cache`` NOTE 4): each takes
    ``checkpoint_pages`` pages, so the cache budget bounds what residents keep. A state is
    kept where the pool has room, after evicting resident sessions (LRU) as a block
    allocation does, then after giving back its own request's earlier points, furthest back
    first (a later point supersedes them: a prompt's end the back points placement asked
    for, a turn's end both). Where there is still none (running and held requests fill the
    pool), an optional point (periodic, aligned, requested, a prompt's end) is not kept, and
    the end state of a request that must export it (``keep_state``) is kept in tensors of
    its own (``checkpoints_unbudgeted``) until its release, when it moves into pages or is
    dropped: a resident holds pages only. A running request short of blocks, once the
    residents are gone, takes the pages of running requests' points, newest request first,
    before it preempts (NOTE 6): they are read only once their request is held or resident.
    Points not kept or given back are counted (``checkpoints_dropped``). Requests that keep
    no state, where residents are off, copy no end state at all.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from disagg.engine.protocol import EngineRequest, SamplingParams, TokenOutput
from disagg.engine.reference.cache_view import SeqInput
from disagg.engine.reference.paged_cache import PagedSeqCache, PagedStateCache, size_cache
from disagg.engine.reference.sampling import sample, token_logprob
from kv_transfer.device import alloc_staging, gather_blocks, scatter_blocks
from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineOptions:
    """Scheduling and memory knobs of the reference engine."""

    block_size: int = 64  # tokens per MLA block (a multiple of the KDA chunk, 64)
    max_num_seqs: int = 16  # running sequences (KDA slots)
    max_num_batched_tokens: int = 2048  # tokens per step
    cache_budget_bytes: int = 256 << 20  # MLA blocks + KDA slots; kept KDA states take blocks (NOTE 10)
    checkpoint_interval: int = 0  # keep KDA checkpoints every N tokens (multiple of block_size; 0 = off)
    resident_sessions: bool = True  # keep finished sessions' state on the device (NOTE 2)
    capture_logits: bool = False  # keep each request's latest sampling logits in ``last_logits`` (tests)
    prompt_checkpoints: bool = True  # keep the KDA state at each prompt's end (resume point of a re-sent prompt)
    aligned_checkpoints: bool = True  # keep the KDA state at each prompt's last block boundary (NOTE 5)
    gil_switch_interval_s: float | None = 0.0005  # NOTE 4 (None: leave the interpreter's setting)
    cuda_graphs: bool = True  # on CUDA, small steps replay their token-wise parts as CUDA graphs (model NOTE 6)
    decode_graphs: bool = True  # with cuda_graphs, decode-only steps replay whole, mixing included (model NOTE 7)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 64:
            raise ValueError(f"block_size must be a positive multiple of 64, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.checkpoint_interval % self.block_size:
            raise ValueError("checkpoint_interval must be a multiple of block_size")


@dataclass(slots=True, repr=False)
class _Kept:
    """A kept KDA state (NOTE 10): in ``pages`` of the MLA pool, or, when the pool had no room for
    a state a request must export, in tensors of its own, (conv, recurrent) stacked over layers."""

    pages: list[int]
    tensors: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True, repr=False)
class _Request:
    request_id: str
    token_ids: list[int]
    num_prompt: int
    sampling: SamplingParams
    keep_state: bool
    first_output_index: int
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    num_computed: int = 0
    num_cached: int = 0
    cached_source: str = "computed"
    checkpoints: dict[int, _Kept] = field(default_factory=dict)  # position -> KDA state (NOTE 10)
    finished: bool = False
    finish_reason: str | None = None
    resume: ResumeState | None = None  # imported at admission, then dropped
    cache_salt: str = ""  # tenant salt (residents are matched within one salt)
    checkpoint_at: tuple[int, ...] = ()  # requested checkpoint positions, ascending (NOTE 7)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


@dataclass(slots=True, repr=False)
class _Resident:
    cache_salt: str  # tenant the state belongs to
    tokens: list[int]  # tokens whose MLA rows are held (computed tokens)
    block_table: list[int]  # pages holding those rows
    checkpoints: dict[int, _Kept]  # position -> KDA state (NOTE 10)


@dataclass(slots=True, frozen=True)
class ResidentChange:
    """A resident session kept, taken back or evicted (NOTE 9)."""

    kind: Literal["kept", "taken", "evicted"]
    resident_id: int  # the engine's id of the resident (unique for the engine's life)
    cache_salt: str  # tenant the state belongs to
    tokens: list[int]  # tokens whose rows it holds (not to be mutated)
    checkpoints: tuple[int, ...]  # positions with a KDA state, ascending
    # "evicted" only, valid during the call: (position, first_block) -> the state there, MLA
    # blocks from ``first_block`` on, in host memory
    export: Callable[[int, int], ResumeState] | None = None


class ReferenceEngine:
    """Synchronous engine (one thread steps it) implementing ``disagg.engine.protocol.Engine``."""

    def __init__(self, model, model_id: str, options: EngineOptions | None = None, eos_token_id: int | None = None):
        self.model = model
        self.model_id = model_id
        self.options = options or EngineOptions()
        self.block_size = self.options.block_size
        dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.layout = model.state_layout(model_id, self.block_size, dtype)
        self.geometry = size_cache(self.layout, self.options.cache_budget_bytes, self.options.max_num_seqs)
        self.cache = PagedStateCache(self.layout, self.geometry, self.device)
        self._graphs = self.options.cuda_graphs  # off CUDA the model has no runner (unless a test installs one)
        self.eos_token_id = eos_token_id if eos_token_id is not None else model.config.eos_token_id
        self.vocab_size = model.config.vocab_size
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._held: dict[str, _Request] = {}
        self._residents: OrderedDict[int, _Resident] = OrderedDict()
        self._next_resident = 0
        self.last_logits: dict[str, torch.Tensor] = {}
        self.resident_version = 0  # bumped whenever the set of resident sessions changes
        self.on_resident: Callable[[ResidentChange], None] | None = None  # NOTE 9
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "device_hit_tokens": 0,
                         "resident_evictions": 0, "preemptions": 0, "delta_base_misses": 0,
                         "checkpoints_dropped": 0, "checkpoints_unbudgeted": 0}  # NOTE 10
        self._kept_pages = 0  # pages holding kept KDA states (NOTE 10)
        gil = self.options.gil_switch_interval_s
        if gil is not None and gil < sys.getswitchinterval():  # NOTE 4
            sys.setswitchinterval(gil)

    # -- admission -------------------------------------------------------------
    @property
    def max_tokens_per_request(self) -> int:
        return self.geometry.num_blocks * self.block_size

    def add_request(self, request: EngineRequest) -> None:
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        need = len(prompt) + request.sampling.max_tokens
        if need > self.max_tokens_per_request:
            raise ValueError(
                f"request needs {need} tokens of cache (prompt {len(prompt)} + max_tokens "
                f"{request.sampling.max_tokens}) but this engine holds at most {self.max_tokens_per_request}"
            )
        if any(r.request_id == request.request_id for r in self._all_live()):
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.resume is not None:
            self._check_resume(request.resume, prompt)
        req = _Request(request.request_id, prompt, len(prompt), request.sampling, request.keep_state,
                       request.first_output_index)
        req.resume = request.resume
        req.cache_salt = request.cache_salt
        req.cached_source = request.cached_source if request.resume is not None else "computed"
        req.checkpoint_at = self._check_points(request.checkpoint_at, len(prompt)) if request.keep_state else ()
        self._waiting.append(req)

    def _check_points(self, points, num_prompt: int) -> tuple[int, ...]:
        """NOTE 7's positions, ascending; a position off a block boundary or outside the prompt is refused."""
        for p in points:
            if p % self.block_size or not 0 < p < num_prompt:
                raise ValueError(f"checkpoint position {p} must be a block boundary inside the prompt "
                                 f"(block_size {self.block_size}, prompt {num_prompt})")
        return tuple(sorted(set(points)))

    def _check_resume(self, state: ResumeState, prompt: list[int]) -> None:
        if state.layout.fingerprint() != self.layout.fingerprint():
            raise ValueError("resume state was produced for another model layout")
        if not 0 < state.position < len(prompt):
            raise ValueError(f"resume position {state.position} must be inside the prompt (len {len(prompt)})")
        bs, k = self.block_size, state.first_block
        if not 0 <= k <= state.position // bs:
            raise ValueError(f"resume state's first block {k} is outside its {state.position // bs} full blocks")
        if len(state.mla_blocks) != state.position // bs - k:
            raise ValueError(f"resume state at {state.position} from block {k} carries {len(state.mla_blocks)} "
                             f"MLA blocks, not {state.position // bs - k}")
        if any(b.start != (k + i) * bs or b.span != bs for i, b in enumerate(state.mla_blocks)):
            raise ValueError("resume state's MLA blocks are out of place")
        if state.tail is not None and (state.tail.start != state.position // bs * bs
                                       or state.tail.span != state.position % bs):
            raise ValueError(f"resume state's tail covers [{state.tail.start}, {state.tail.start + state.tail.span}), "
                             f"not the partial block ending at {state.position}")
        if not state.kda:
            raise ValueError("resume state carries no KDA state")

    def _all_live(self):
        yield from self._waiting
        yield from self._running
        yield from self._held.values()

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def abort(self, request_id: str) -> list[TokenOutput]:
        for req in list(self._waiting) + self._running:
            if req.request_id == request_id:
                if req in self._waiting:
                    self._waiting.remove(req)
                else:
                    self._running.remove(req)
                    self._free(req, keep=False)
                return [self._output(req, [], "abort")]
        if request_id in self._held:
            self.release(request_id, keep_resident=False)
        return []

    # -- memory --------------------------------------------------------------------
    def _ensure_blocks(self, req: _Request, upto: int) -> bool:
        need = math.ceil(upto / self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        while not self.cache.blocks.can_allocate(need) and self._residents:
            self._evict_resident()
        if not self.cache.blocks.can_allocate(need):
            self._reclaim_points(need)
        if not self.cache.blocks.can_allocate(need):
            return False
        req.block_table.extend(self.cache.blocks.allocate(need))
        return True

    def _evict_resident(self) -> None:
        rid, res = self._residents.popitem(last=False)
        if self.on_resident is not None:  # NOTE 9: the hook may copy the state out first
            def export(position: int, first_block: int = 0) -> ResumeState:
                if position not in res.checkpoints:
                    raise ValueError(f"no KDA checkpoint at {position} (have {sorted(res.checkpoints)})")
                return self._gather(res.block_table, self._state(res.checkpoints[position]), position, first_block)

            self._tell("evicted", rid, res, export)
        self._drop_all(res.checkpoints)
        self.cache.blocks.free(res.block_table)
        self.resident_version += 1
        self.counters["resident_evictions"] += 1

    def _free(self, req: _Request, keep: bool) -> None:
        """Give back ``req``'s slot; ``keep``: its end state is kept where it will be read (exported,
        or resident), its pages and checkpoints stay; else they go too."""
        if req.slot >= 0:
            if keep and (req.keep_state or (self.options.resident_sessions and req.block_table)):
                self._keep(req, required=req.keep_state)
            self.cache.free_slot(req.slot)
            req.slot = -1
        if not keep:
            self._drop_all(req.checkpoints)
            self.cache.blocks.free(req.block_table)
            req.block_table = []

    # -- kept KDA states (NOTE 10) -----------------------------------------------------------
    def _keep(self, req: _Request, required: bool = False) -> None:
        """Keep ``req``'s KDA state at its position (its slot's), unless one is kept there already
        (the same arithmetic gave it). Its earlier points give it room, furthest back first."""
        if req.num_computed in req.checkpoints:
            return
        slot = (self.cache.conv_all[:, req.slot], self.cache.rec_all[:, req.slot])
        pages = self._pages(req.checkpoints)
        if pages is not None:
            self.cache.save_state(*slot, pages)
            req.checkpoints[req.num_computed] = _Kept(pages)
        elif required or not self.geometry.checkpoint_pages:  # no pages at all: the model has no MLA pool
            self.counters["checkpoints_unbudgeted"] += bool(self.geometry.checkpoint_pages)
            req.checkpoints[req.num_computed] = _Kept([], (slot[0].clone(), slot[1].clone()))
        else:
            self.counters["checkpoints_dropped"] += 1

    def _pages(self, owner: dict[int, _Kept] | None = None) -> list[int] | None:
        """Room for one kept state, after evicting resident sessions as needed, then giving back
        ``owner``'s points (the keeping request's own), furthest back first; None: none. Block 0
        pads decode batches' tables: never a state's (paged_cache NOTE 4)."""
        k = self.geometry.checkpoint_pages
        if not k:
            return None
        blocks = self.cache.blocks

        def room() -> bool:
            return blocks.can_allocate(k + blocks.is_free(0))

        while not room() and self._residents:
            self._evict_resident()
        for p in sorted(owner or ()):
            if room():
                break
            self._drop(owner.pop(p))
            self.counters["checkpoints_dropped"] += 1
        if not room():
            return None
        pages = blocks.allocate(k)
        if 0 in pages:
            pages[pages.index(0)] = blocks.allocate(1)[0]
            blocks.free([0])
        self._kept_pages += k
        return pages

    def _reclaim_points(self, need: int) -> None:
        """Give back running requests' kept states, newest request first, until ``need`` pages are
        free (NOTE 10: a running request's points are read only once it is held or resident)."""
        for r in reversed(self._running):
            for p in sorted(r.checkpoints, reverse=True):
                self._drop(r.checkpoints.pop(p))
                self.counters["checkpoints_dropped"] += 1
                if self.cache.blocks.can_allocate(need):
                    return

    def _state(self, kept: _Kept) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent), stacked over layers, as new tensors."""
        if kept.tensors is not None:
            return kept.tensors[0].clone(), kept.tensors[1].clone()
        return self.cache.read_state(kept.pages)

    def _load(self, kept: _Kept, slot: int) -> None:
        if kept.tensors is None:
            self.cache.load_state(kept.pages, slot)
        else:
            self.cache.conv_all[:, slot].copy_(kept.tensors[0])
            self.cache.rec_all[:, slot].copy_(kept.tensors[1])

    def _drop(self, kept: _Kept) -> None:
        if kept.pages:
            self._kept_pages -= len(kept.pages)
            self.cache.drop_state(kept.pages)

    def _drop_all(self, checkpoints: dict[int, _Kept]) -> None:
        for kept in checkpoints.values():
            self._drop(kept)
        checkpoints.clear()

    def _make_resident(self, req: _Request) -> None:
        end = req.num_computed
        kept, req.checkpoints = req.checkpoints, {}
        for p, c in sorted(kept.items(), reverse=True):  # a resident holds pages only (NOTE 10)
            if c.tensors is not None and p in kept:  # (not given back for a later point's room)
                del kept[p]
                pages = self._pages(kept) if p <= end and self.options.resident_sessions else None
                if pages is not None:
                    self.cache.save_state(*c.tensors, pages)
                    kept[p] = _Kept(pages)
        if not self.options.resident_sessions or end not in kept or not req.block_table:
            self._drop_all(kept)
            self.cache.blocks.free(req.block_table)
            req.block_table = []
            return
        for p in [p for p in kept if p > end]:
            self._drop(kept.pop(p))
        res = self._residents[self._next_resident] = _Resident(req.cache_salt, req.token_ids[:end], req.block_table,
                                                                kept)
        self._next_resident += 1
        self.resident_version += 1
        req.block_table = []
        if self.on_resident is not None:
            self._tell("kept", self._next_resident - 1, res)

    def _tell(self, kind: str, rid: int, res: _Resident, export=None) -> None:
        """NOTE 9: the hook hears of the change; its failure is logged, never the engine's."""
        try:
            self.on_resident(ResidentChange(kind, rid, res.cache_salt, res.tokens, tuple(sorted(res.checkpoints)),
                                            export))
        except Exception:  # noqa: BLE001 - a mirror of the device tier is best effort
            log.warning("resident hook failed on a %s session", kind, exc_info=True)

    def resident_match(self, tokens: list[int], cache_salt: str = "") -> tuple[int | None, int]:
        """(resident id, position) of the furthest resident checkpoint that ``tokens`` extends.

        A session is resumable at any of its checkpoints (prompt end, turn end, periodic)
        whose prefix ``tokens`` repeats, strictly inside ``tokens``.
        """
        best, best_len, _, _ = self._scan_residents(tokens, cache_salt)
        return best, best_len

    def resident_blocks(self, tokens: list[int], cache_salt: str = "") -> tuple[int | None, int]:
        """(resident id, n) of the resident session holding the most leading full blocks of
        ``tokens``' MLA rows, n of them (NOTE 8: a delta import needs the rows, not a checkpoint)."""
        _, _, rows, n = self._scan_residents(tokens, cache_salt)
        return rows, n

    def resident_extent(self, tokens: list[int], cache_salt: str = "") -> tuple[int, int]:
        """(``resident_match``'s position, ``resident_blocks``' block count) in one pass."""
        _, best_len, _, n = self._scan_residents(tokens, cache_salt)
        return best_len, n

    def _scan_residents(self, tokens: list[int], cache_salt: str) -> tuple[int | None, int, int | None, int]:
        """One pass over the residents of ``cache_salt``: (id, position) of the furthest checkpoint
        ``tokens`` extends (a tie goes to the closest session: its own, not another's shared
        prefix), and (id, n) of the one holding the most leading full blocks of ``tokens``."""
        bs = self.block_size
        best, best_len, best_common, rows, best_n = None, 0, 0, None, 0
        for rid, res in self._residents.items():
            if res.cache_salt != cache_salt:
                continue
            common = _common_prefix(res.tokens, tokens)
            p = max((q for q in res.checkpoints if best_len <= q <= common and q < len(tokens)), default=0)
            if p > best_len or (p == best_len and p and common > best_common):
                best, best_len, best_common = rid, p, common
            n = min(common, len(res.tokens)) // bs
            if n > best_n:
                rows, best_n = rid, n
        return best, best_len, rows, best_n

    def _take_pages(self, req: _Request, rid: int, keep: int, position: int) -> None:
        """``req``'s first ``keep`` pages from resident ``rid``, whose rows it repeats up to
        ``position``: a copy when the resident is a prefix others share (or wanted by another),
        else adopted, its later pages freed (NOTE 2)."""
        res = self._residents[rid]
        n = len(req.token_ids)
        shared = (2 * position < len(res.tokens) or (n <= len(res.tokens) and res.tokens[:n] == req.token_ids)
                  or self._wanted_by_another(req, res.tokens, position))
        if shared and self.cache.blocks.can_allocate(keep):  # a shared prefix, or wanted by another (NOTE 2)
            req.block_table = self.cache.blocks.allocate(keep)
            self.cache.mla_all[:, req.block_table] = self.cache.mla_all[:, res.block_table[:keep]]
            self._residents.move_to_end(rid)
        else:
            del self._residents[rid]
            self.resident_version += 1
            if self.on_resident is not None:
                self._tell("taken", rid, res)
            self._drop_all(res.checkpoints)  # the caller has read the one it resumes from
            self.cache.blocks.free(res.block_table[keep:])  # pages past the resume point go back to the pool
            req.block_table = res.block_table[:keep]

    def _adopt_resident(self, req: _Request) -> None:
        best, best_len = self.resident_match(req.token_ids, req.cache_salt)
        if best is None:
            return
        self._load(self._residents[best].checkpoints[best_len], req.slot)  # before the pages are taken
        self._take_pages(req, best, -(-best_len // self.block_size), best_len)
        req.num_computed = req.num_cached = best_len
        req.cached_source = "device"
        self.counters["device_hit_tokens"] += best_len

    def _wanted_by_another(self, req: _Request, tokens: list[int], position: int) -> bool:
        """Whether another queued request without a state of its own extends ``tokens[:position]``."""
        last = tokens[position - 1]
        return any(o is not req and o.resume is None and o.cache_salt == req.cache_salt
                   and len(o.token_ids) > position and o.token_ids[position - 1] == last
                   and o.token_ids[:position] == tokens[:position] for o in self._waiting)

    def _import(self, req: _Request, state: ResumeState) -> bool | None:
        """Admit ``req`` at ``state``: True, False (no memory yet: it waits), None (a delta state
        whose base rows left the device: NOTE 8)."""
        bs, k = self.block_size, state.first_block
        if k:  # NOTE 8: the rows before the delta, from a resident session
            rid, held = self.resident_blocks(req.token_ids, req.cache_salt)
            if rid is None or held < k:
                return None
            self._take_pages(req, rid, k, k * bs)
        if not self._ensure_blocks(req, state.position):
            if req.block_table:  # a waiting request holds no pages (an abort frees none)
                self.cache.blocks.free(req.block_table)
                req.block_table = []
            return False
        n = len(state.mla_blocks)
        if n:  # one batched scatter per layer group through (pinned) staging, never a copy per block
            staging = state.mla_rows  # already one buffer when the loader decoded into one
            if staging is not None and staging.is_cuda and staging.device != self.cache.mla_all.device:
                staging = staging.to(self.cache.mla_all.device)  # a peer device's buffer: one peer copy
            if staging is None or staging.dtype != self.cache.mla_all.dtype:
                first = state.mla_blocks[0].rows
                staging = alloc_staging((first.shape[0], n * bs, first.shape[2]), first.dtype,
                                        pin=self.device.type == "cuda")
                torch.cat([b.rows for b in state.mla_blocks], dim=1, out=staging)
            scatter_blocks(staging, self.cache.mla_all, req.block_table[k:k + n]).wait()
        if state.tail is not None:
            start = (state.position // bs) * bs
            for layer in range(self.layout.num_mla_layers):
                self.cache.write_rows(layer, req.block_table, start, state.tail.rows[layer].to(self.device))
        kda = state.kda[0]  # every layer's state in one copy per kind (not a copy per layer: each
        self.cache.conv_all[:, req.slot].copy_(kda.conv)  # pageable one waits for the device)
        self.cache.rec_all[:, req.slot].copy_(kda.recurrent)
        req.num_computed = req.num_cached = state.position
        return True

    # -- export ------------------------------------------------------------------------
    def export_state(self, request_id: str, position: int | None = None, first_block: int = 0,
                     on_device: bool = False) -> ResumeState:
        """State of a held (or running) request at ``position`` (default: its current position).

        ``on_device``: gather into buffers on the engine's device instead of host staging
        (a device-to-device hand-off shares them: ``kv_transfer.transport.device_ipc``)."""
        req = self._held.get(request_id) or next((r for r in self._running if r.request_id == request_id), None)
        if req is None:
            raise KeyError(f"no live or held request {request_id!r}")
        position = req.num_computed if position is None else position
        if position == req.num_computed and req.slot >= 0:
            kda = (self.cache.conv_all[:, req.slot].clone(), self.cache.rec_all[:, req.slot].clone())
        elif position in req.checkpoints:
            kda = self._state(req.checkpoints[position])
        else:
            raise ValueError(f"no KDA checkpoint at {position} (have {sorted(req.checkpoints)} and {req.num_computed})")
        return self._gather(req.block_table, kda, position, first_block, on_device)

    def export_resident(self, resident_id: int, position: int, first_block: int = 0) -> ResumeState | None:
        """State of resident session ``resident_id`` at its checkpoint ``position``, MLA blocks from
        ``first_block`` on, in host memory (a node mate recalls it: ``disagg.workers.holds`` NOTE 5);
        None once the session is no longer resident."""
        res = self._residents.get(resident_id)
        if res is None:
            return None
        if position not in res.checkpoints:
            raise ValueError(f"no KDA checkpoint at {position} (have {sorted(res.checkpoints)})")
        return self._gather(res.block_table, self._state(res.checkpoints[position]), position, first_block)

    def _gather(self, block_table: list[int], kda: tuple[torch.Tensor, torch.Tensor], position: int,
                first_block: int = 0, on_device: bool = False) -> ResumeState:
        """The state at ``position`` of the rows in ``block_table`` and the KDA state ``kda``
        ((conv, recurrent) stacked over layers, the caller's own tensors)."""
        conv_t, rec_t = kda
        bs = self.block_size
        n_full = position // bs
        blocks, staging = [], None
        if n_full > first_block:  # one batched gather into (pinned) host staging, or a device buffer
            out = None
            if on_device:
                mla = self.cache.mla_all
                out = torch.empty((mla.shape[0], (n_full - first_block) * bs, mla.shape[-1]), dtype=mla.dtype,
                                  device=mla.device)
            staging, done = gather_blocks(self.cache.mla_all, block_table[first_block:n_full], out)
            done.wait()
            blocks = [MLABlock(staging[:, i * bs : (i + 1) * bs], (first_block + i) * bs, bs)
                      for i in range(n_full - first_block)]
        tail = None
        if position % bs:
            start = n_full * bs
            rows = torch.stack([self.cache.read_rows(m, block_table, start, position)
                                for m in range(self.layout.num_mla_layers)])
            tail = MLABlock(rows if on_device else rows.cpu(), start, position - start)
        kda_state = KDACheckpoint(conv_t if on_device else conv_t.cpu(), rec_t if on_device else rec_t.cpu(), position)
        return ResumeState(self.layout, position, blocks, first_block, tail, [kda_state], mla_rows=staging)

    def checkpoint_positions(self, request_id: str) -> list[int]:
        """Positions where a held request has a KDA checkpoint (prompt end, turn end, periodic)."""
        return sorted(self._held[request_id].checkpoints)

    def computed_tokens(self, request_id: str) -> list[int]:
        req = self._held[request_id]
        return req.token_ids[: req.num_computed]

    def release(self, request_id: str, keep_resident: bool = True) -> None:
        req = self._held.pop(request_id, None)
        if req is None:
            return
        if keep_resident:
            self._make_resident(req)
        else:
            self._drop_all(req.checkpoints)
            self.cache.blocks.free(req.block_table)
            req.block_table = []

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        budget = self.options.max_num_batched_tokens
        plan: list[tuple[_Request, int]] = []
        outputs: list[TokenOutput] = []
        # Running requests are planned oldest first. One that cannot get its blocks preempts the
        # newest running request (never one planned already: those are older) until it can, or
        # until it is the newest itself and goes back to the queue (NOTE 6).
        i = preempted = 0
        starved = False  # the oldest request waits for blocks held for export
        while i < len(self._running):
            req = self._running[i]
            n = self._chunk(req, budget)
            ok = n <= 0 or self._ensure_blocks(req, req.num_computed + n)
            while not ok:
                victim = self._running[-1]
                if victim is req:  # nothing newer is left to preempt
                    if i > 0:
                        self._preempt(req)
                        preempted += 1
                    else:  # the oldest keeps what it has and waits (NOTE 6)
                        starved = True
                        i += 1
                    break
                self._preempt(victim)
                preempted += 1
                ok = self._ensure_blocks(req, req.num_computed + n)
            if ok:
                if n > 0:
                    plan.append((req, n))
                    budget -= n
                i += 1
        while not (preempted or starved) and self._waiting and budget > 0 and self.cache.num_free_slots > 0:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            self._running.append(req)
            n = self._chunk(req, budget)
            if n > 0 and self._ensure_blocks(req, req.num_computed + n):
                plan.append((req, n))
                budget -= n
        if not plan:
            return outputs
        seqs = []
        for req, n in plan:
            ids = torch.as_tensor(req.token_ids[req.num_computed : req.num_computed + n], device=self.device)
            view = PagedSeqCache(self.cache, req.block_table, req.slot, req.num_computed)
            seqs.append(SeqInput(ids, req.num_computed, view))
        with torch.inference_mode():
            logits = self.model.forward(seqs, graphs=self._graphs, decode_graphs=self.options.decode_graphs)
        self.counters["steps"] += 1
        for (req, n), lg in zip(plan, logits, strict=True):
            req.num_computed += n
            if n == 1 and req.num_output > 0:
                self.counters["decode_tokens"] += 1
            else:
                self.counters["prefill_tokens"] += n
            if req.num_computed < len(req.token_ids):
                self._maybe_checkpoint(req)
                continue
            if (req.num_computed == req.num_prompt and self.options.prompt_checkpoints
                    and (req.keep_state or self.options.resident_sessions)):  # read only once held or resident
                self._keep(req)  # where a replayed prompt resumes
            if self.options.capture_logits:
                self.last_logits[req.request_id] = lg[-1].detach().clone()
            token = sample(lg[-1], req.sampling, req.first_output_index + req.num_output)
            req.token_ids.append(token)
            reason = self._finish_reason(req, token)
            out = self._output(req, [token], reason)
            if req.sampling.logprobs is not None:  # from the logits the token was sampled from
                out.logprobs = [token_logprob(lg[-1], token, req.sampling.logprobs)]
            outputs.append(out)
            if reason is not None:
                self._finish(req)
        return outputs

    def _chunk(self, req: _Request, budget: int) -> int:
        todo = len(req.token_ids) - req.num_computed
        n = min(todo, budget)
        if n < todo:  # a partial chunk must end on a block boundary
            n = ((req.num_computed + n) // self.block_size) * self.block_size - req.num_computed
        every = self.options.checkpoint_interval
        if req.keep_state and every and todo > 1:  # stop at the next checkpoint boundary to take one there
            n = min(n, (req.num_computed // every + 1) * every - req.num_computed)
        aligned = self._aligned_point(req)
        if req.num_computed < aligned:  # stop at the prompt's last block boundary (NOTE 5)
            n = min(n, aligned - req.num_computed)
        nxt = next((p for p in req.checkpoint_at if p > req.num_computed), 0)
        if nxt:  # and at the next requested checkpoint (NOTE 7)
            n = min(n, nxt - req.num_computed)
        return max(n, 0)

    def _aligned_point(self, req: _Request) -> int:
        """The prompt's last block boundary short of its end, where NOTE 5 keeps a checkpoint (0: none)."""
        if not (req.keep_state and self.options.aligned_checkpoints):
            return 0
        a = (req.num_prompt // self.block_size) * self.block_size
        return a if 0 < a < req.num_prompt else 0

    def _admit(self, req: _Request) -> bool:
        req.slot = self.cache.allocate_slot()
        state = req.resume
        if state is not None:
            ok = self._import(req, state)
            if ok is False:
                self.cache.free_slot(req.slot)
                req.slot = -1
                return False
            req.resume = None
            if ok is None:  # NOTE 8: what the device still holds, and compute the rest
                self.counters["delta_base_misses"] += 1
                req.cached_source = "computed"
                self._adopt_resident(req)
        else:
            self._adopt_resident(req)
        if req.num_computed:  # resumed at a point a computed run keeps (NOTE 5, NOTE 7): keep it too
            self._maybe_checkpoint(req)
        return True

    def _preempt(self, victim: _Request) -> None:
        """Back to the head of the queue, its blocks and slot freed: it recomputes when admitted."""
        self._running.remove(victim)
        self._free(victim, keep=False)
        victim.num_computed = victim.num_cached = 0  # what it reused is recomputed (usage says so)
        victim.cached_source = "computed"
        self._waiting.appendleft(victim)
        self.counters["preemptions"] += 1

    def _maybe_checkpoint(self, req: _Request) -> None:
        every = self.options.checkpoint_interval
        if ((req.keep_state and every and req.num_computed % every == 0) or req.num_computed == self._aligned_point(req)
                or req.num_computed in req.checkpoint_at):
            self._keep(req)

    def _finish_reason(self, req: _Request, token: int) -> str | None:
        sp = req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token == self.eos_token_id):
            return "stop"
        if req.num_output >= sp.max_tokens:
            return "length"
        return None

    def _finish(self, req: _Request) -> None:
        self._running.remove(req)
        req.finished = True
        self._free(req, keep=True)
        if req.keep_state:
            self._held[req.request_id] = req
        else:
            self._make_resident(req)

    def _output(self, req: _Request, tokens: list[int], reason: str | None) -> TokenOutput:
        req.finish_reason = reason
        return TokenOutput(req.request_id, tokens, reason is not None, reason, req.num_prompt,
                           req.num_cached, req.cached_source)

    # -- convenience ---------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> tuple[list[int], TokenOutput]:
        """Run one request to completion alone (tests, CLI). Returns (output ids, last output)."""
        self.add_request(request)
        tokens: list[int] = []
        last = None
        while True:
            steps = self.counters["steps"]
            for out in self.step():
                if out.request_id == request.request_id:
                    tokens.extend(out.new_token_ids)
                    last = out
            if last is not None and last.finished:
                return tokens, last
            if not self.has_work() or self.counters["steps"] == steps:  # nothing else can unblock it
                raise RuntimeError(f"engine stalled: {self.stats()}")

    def resident_contents(self) -> list[tuple[str, list[int], list[int]]]:
        """(cache salt, computed tokens, KDA checkpoint positions) of every resident session (the
        device tier's content: a session resumes only where it has a checkpoint)."""
        return [(r.cache_salt, r.tokens, sorted(r.checkpoints)) for r in self._residents.values()]

    def load(self) -> dict:
        """Queue and cache figures a router weighs."""
        queued = sum(len(r.token_ids) - r.num_computed for r in self._waiting)
        queued += sum(len(r.token_ids) - r.num_computed for r in self._running if len(r.token_ids) - r.num_computed > 1)
        decodes = [r for r in self._running if len(r.token_ids) - r.num_computed == 1]
        return {"queued_prefill_tokens": queued,
                "queued_prefill_requests": len(self._waiting) + len(self._running) - len(decodes),
                "running_decode_requests": len(decodes),
                "running_decode_tokens": sum(len(r.token_ids) for r in decodes),
                "cache_utilization": 1.0 - self.cache.blocks.num_free / self.geometry.num_blocks,
                "device_tokens": self.geometry.num_blocks * self.block_size}

    def stats(self) -> dict:
        return dict(self.counters, free_blocks=self.cache.blocks.num_free, num_blocks=self.geometry.num_blocks,
                    block_bytes=self.geometry.block_bytes, checkpoint_blocks=self._kept_pages,
                    resident_sessions=len(self._residents), running=len(self._running),
                    waiting=len(self._waiting), held=len(self._held), time=time.time())


_PREFIX_CHUNK = 512


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token sequences: slices compared a chunk at a time
    (in C), then the first differing chunk token by token. It runs under the engine lock for
    every resident session on every request, so a per-token Python loop over a 100K-token
    agentic context (4 ms per resident) would stall the engine."""
    if type(a) is not type(b):
        a, b = list(a), list(b)
    n = min(len(a), len(b))
    i = 0
    while i + _PREFIX_CHUNK <= n and a[i : i + _PREFIX_CHUNK] == b[i : i + _PREFIX_CHUNK]:
        i += _PREFIX_CHUNK
    end = min(n, i + _PREFIX_CHUNK)
    while i < end and a[i] == b[i]:
        i += 1
    return i
