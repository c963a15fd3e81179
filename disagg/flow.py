"""The decode-side request flow, written once over two small interfaces.

Both workers (``disagg.workers.tiered.StatefulWorker`` over the reference engine,
``disagg.workers.vllm.VLLMWorker`` over vLLM) are adapters of the two
interfaces below and run this flow; neither has a decode flow of its own.

    RequestFlow.generate(params, prefill_fn)
      0 reuse      ticket: bound, planned checkpoints (NOTE 7); wait for a publish in flight (NOTE 8)
      1 plan       resume = longest of (engine.resident_length,          [resume planned]
                                        state.lookup -> state.load)
      2 decide     PDDecider.decide(suffix = prompt - resume,             [decision taken]
                                    prefill_pool(params): loads, uncached,
                                    engine.live_requests())
      3 remote     prefill_fn(params), retried with backoff -> PrefillHandle
                   stream its first token; state.open(handle)             [load result]
                   (a miss or a failure: recompute here, never a wrong token)
      4 decode     engine.generate(EngineRequest(prompt [+ first token]), resume state)
      5 turn end   engine.checkpoint_positions / export_state ->          (background)
                   state.publish, then engine.release
      6 retain     a session's superseded checkpoints -> state.demote     (background, NOTE 9)
                   (a session's last turn, ``session_end``: no publish; its
                   private state -> state.demote, demote_blocks, NOTE 13)

``FlowEngine`` is what the flow needs of an engine (``disagg.engine.async_engine.AsyncEngine``
and ``disagg.engine.vllm.engine.VLLMEngine`` implement it); ``FlowState`` is what it needs of
the node's state tiers (``disagg.workers.tiered.TierState`` over a ``kv_transfer`` store,
``disagg.workers.vllm.ConnectorState`` where vLLM's connector moves the bytes).
Fault injection wraps these (``disagg.faults.FaultyState``, ``FaultInjector.guard_decode``).

NOTES
1. Bulk state never travels in a Ray message: only ``PrefillHandle``.
2. ``num_cached_tokens`` counts prompt tokens whose state was reused (by the
   prefill worker when one ran); the hand-off itself is a transfer, not a hit.
3. Any failure of the state path degrades to recompute: a tier that errors, a
   checksum that fails, a lookup or load past ``load_deadline_s``.
4. A resumed request (``resumed_output_tokens > 0``: its prompt ends with its own
   earlier output, after its decode replica was lost) samples output index
   ``resumed_output_tokens`` next (plus one after a remote prefill's first token),
   so seeded sampling continues where it stopped.
5. The P/D decision is ``disagg.router.decider.PDDecider``, the object the router and the
   simulator decide with, fed as the simulator feeds it: the suffix is measured here (this
   worker's real resume point); the prefill pool comes from ``prefill_pool(PoolQuery)``, a
   ``disagg.router.metrics.PoolView`` (the Serve adapter's view of the prefill replicas,
   ``deployments.request_router.prefill_pool_view``): per replica its effective loads and
   the prompt tokens it could not resume, by the prefix-index walk that places the prefill
   (the decider's "local_state" rule). The query carries the prompt's digests (hashed once,
   ``ReuseTicket.hashes``) and what this worker's lookup found in its node's shared tiers
   (``Resume.node_position``): a prefill replica on this node reads those tiers too, and
   the pool's router does not see their events. The decode batch a local prefill would
   stall is this engine's live requests (``FlowEngine.live_requests``, the figure its
   replica reports to the router as running decodes, plus any local prefill in progress),
   and the decodes on their way to it are the requests in this flow not finished, the
   asking one aside (``unfinished``: as the router counts those it routed to a worker).
   A pool not known yet
   (or whose view fails) counts as one idle replica of unknown cache; a pool whose replicas
   have not reported their model yet has loads but unknown cache ("local_state" is off for
   that request); no ``prefill_fn``: no pool.
6. A session's next turn waits (at most ``load_deadline_s``) for its previous turn end's
   publish, so it takes that state over instead of recomputing it.
7. Reuse accounting (``disagg.reuse``): the flow notes every prompt in its ledger
   (``begin``), asks where its prefill keeps extra checkpoints (``checkpoint_at``), gives
   every prompt token it recomputed below the infinite-cache bound one reason (``finish``,
   reported on the request's last chunk) and notes what each publish stored. The calls are
   marked ``# reuse:``; the logic lives in ``disagg.reuse``.
8. A lookup does not race a publish it can see coming: when the ledger shows a publish in
   flight (another request's prefill, e.g. the first session to branch off a shared system
   prompt) at a point past every published resume point of the prompt, the request waits for
   it to land or be dropped, at most ``publish_wait_s`` (default ``load_deadline_s``), before
   it looks up. A request's own points are noted in flight before its first await
   (``ReuseAccounting.begin``), and every request settles them (published or dropped) when
   its publishes are over, however it ends, so a waiter never waits on a publish that will
   not come for longer than the bound. A request that prefills locally publishes its points
   only with its turn end, after its whole decode: it drops its in-flight notes as soon as it
   decides (``unpend``), so waiters look up at once instead.
9. Retention (``disagg.reuse.retention``): whenever a session's checkpoints land (a prefill
   replica's, by its handle, or this worker's turn end), the reuse accounting names the
   session's private checkpoints of earlier turns beyond its newest ``keep_checkpoints``
   and, with ``keep_turns``, those of turns older than its newest N (N fixed, or learned from
   how many turns back its prompts could resume: ``ReuseAccounting.finish``, retention NOTE 6)
   (``superseded``; a request's prefill and turn end are one turn, its ``request_id``), and
   with ``speculative_first``, at a turn end, the private speculative points of a prefill that
   ran here (the placement's start prior, retention's docstring; a hand-off's stay the
   session's state on this node: docs/router.md, "Round 37"). The flow has the node's tiers
   evict them first (``FlowState.demote``: in the background after a prefill's hand-off,
   within the turn end's background publish).
   Points on a prefix another session started with are never demoted. A demote only reorders
   eviction: a demoted point read again is served (and refreshed), one evicted is recomputed.
10. Peer resume: a request this worker sends to the prefill pool names this node and what its
   lookup found in the node's shared tiers (``GenerateParams.state_node`` / ``state_position``:
   the session's hand-offs and turn ends land here, where its prefill replica, on another node,
   does not look), unless the request already names a node holding more: the router names a
   moved session's last node (``RouteDecision.state_node``, router step 4), which this
   worker's own lookup also reads first. A prefill replica on another node whose own device and tiers resume less
   loads that prefix through the named node's state service (``FlowState.load`` with its
   ``node_id``), within the same load deadline; a miss there (evicted since, no state service
   for that node, a failed checksum) resumes what its own node holds. With the router
   policy's ``peer_reads`` the pool view also credits it to the pool for the P/D decision, as
   the simulator's router then does (``disagg.router.match.credit_node_state``; off by
   default: docs/router.md "Round 5").
11. Delta loads: the engine's resident sessions often hold most of a prompt's rows (the
   decode replica decoded the session's last turn; a prefill replica prefilled it). The plan
   asks the engine, in the same hop as its resident resume point, for the leading full blocks
   it holds (``resident_extent``), and every load of this request (a resume from the tiers,
   a peer resume, the prefill's hand-off) skips their rows (``first_block``): the state moves
   only the blocks after them, plus the tail and KDA state at its position. The engine takes
   the rows it skipped from its resident session at admission, or computes them if that
   session was evicted in between (reference engine NOTE 8). A device hand-off (one peer copy
   on the host) carries the whole state.
12. One copy after a cross-node hand-off: a prefill replica on another node published the
   prompt's state on its node for the hand-off; once this worker has loaded it, the session
   lives here (its turn end lands on this node, which its next turn names: NOTE 10), and the
   copy there would only push out the sessions that node serves. The flow has that node's
   tiers evict the prompt's private MLA blocks first (``FlowState.demote_blocks``, over its
   state service; the prefill demotes its checkpoints itself, tiered NOTE 3), the end of the
   context first, in the background. Private: past the leading blocks the reuse accounting
   knows another session sent (``ReuseAccounting.shared_blocks``: a system prompt, a
   conversation's parent). Demoting only reorders eviction: the blocks stay readable until
   evicted and a read refreshes them (a shared prefix this worker had not seen shared, the
   session's next prefill on that node). Doing it after the load, not as the prefill
   publishes, keeps the hand-off's own blocks from being the first evicted before the load.
13. A session's end, when its client says so (``GenerateParams.session_end``: the API's
   ``session_end`` on the session's last turn). Nothing will resume the session, yet by
   recency its state, the newest, is the last of any to go, behind sessions in their think
   time: serving is told nothing else about a session's end. When the last turn finishes the
   flow publishes no turn end, releases the engine's request without keeping it resident, and
   has this node's tiers evict the session's private state first, in the background: the
   checkpoints its retention still tracks (``ReuseAccounting.end_session``), then the
   prompt's private MLA blocks, the end of the context first (``FlowState.demote_blocks``
   with this node). Private is as in NOTE 12; a prefill's copy on another node went at the
   hand-off (NOTE 12, tiered NOTE 3). Over vLLM the state is the blocks its connector saved
   (``ConnectorState``): the engine keeps nothing to release, and the request tells the
   connector to save none of the turn (``EngineRequest.save_state``; the connector's
   scheduler side NOTE 4), so what is demoted is what earlier turns saved. A client that says so
   wrongly costs a recompute of what was evicted since, never a wrong token: demoted state is
   read (and refreshed) until evicted.
14. A session ended after the fact (``end_session_by_id``: the API's ``DELETE
   /v1/sessions/{id}``, for a client that learns of the end only after its last turn): as
   NOTE 13 without the turn, so the blocks come from the reuse ledger, every block the
   session sent first and no other session sent (``ReuseAccounting.private_blocks``,
   ledger NOTE 4), the end of its context first, after the checkpoints its retention
   tracks. What an engine keeps resident of the session stays until the engine evicts it.
   The ledger is this worker's: the ingress asks every decode replica, and each demotes
   what it saw.
15. Inbound decodes: a request this worker sends to the prefill pool is on its way to this
   engine's batch from the decision until its decode goes to the engine (or it ends: a
   one-token answer, a failure, a client gone). The engine does not see it then, so the
   flow counts it (``inbound``, ``inbound_tokens``: its prompt) and the replica reports it
   beside the engine's load (``routing_load``; ``WorkerState.inbound_decode_requests``).
   Counted by the running batch alone, a worker whose requests are all still in the pool
   looks idle, and the router sends it the next ones too (docs/router.md, "Round 20").
   A remote prefill that fails and runs here instead stops counting at once: it is in the
   engine's queue.
16. Recalls (``recall_s`` > 0: ``transfer.host.victim``): when neither this engine's device
   nor the node's tiers hold a full block of the prompt past what the plan resumes, the flow
   asks the node's other devices for the rest (``FlowState.recall``; ``kv_transfer.tiers.host``
   NOTE 9) within the lookup's deadline, and looks up again if any came back, the blocks the
   engine holds resident counted as present (the load skips them, NOTE 11). A node mate
   that holds them writes them back (``disagg.workers.holds`` NOTE 5); the lookup finds
   nothing to recall in one round trip otherwise. The wait ends when the mates have answered;
   its limit is ``transfer.host.recall_ms``, or, with ``router.engine_profile``, as long as the
   profile says computing the tokens asked for takes, when longer: a write-back of a long
   context at K3's bytes a token takes longer than the default (about 0.8 s at 128K on one
   H100, docs/router.md "Round 42"), and a recall that stops short of it computes them all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from disagg.config import KEEP_CHECKPOINTS, KEEP_TURNS
from disagg.costs import cost_profile
from disagg.engine.protocol import EngineRequest, SamplingParams, TokenOutput
from disagg.messages import GenerateParams, PrefillHandle, StreamChunk
from disagg.reuse.accounting import ReuseAccounting, ReuseTicket
from disagg.reuse.placement import CheckpointPlacement
from disagg.reuse.retention import PublishedPoint, SessionCheckpoints
from disagg.router.decider import DeciderConfig, PDDecider, PDDecision
from disagg.router.metrics import PoolQuery, PoolView
from disagg.session import session_key
from kv_transfer.keys import BlockHasher

if TYPE_CHECKING:
    from disagg.config import AppConfig
    from disagg.costs import CostModel

log = logging.getLogger(__name__)

PrefillFn = Callable[[GenerateParams], Awaitable[PrefillHandle]]
ReleaseFn = Callable[[PrefillHandle], Awaitable[None]]
PoolFn = Callable[[PoolQuery], "PoolView | None"]  # the prefill pool for one request (NOTE 5)
COUNTERS = ("prefills", "decodes", "remote_prefills", "local_prefills", "load_failures", "load_timeouts",
            "prefill_failures", "published_bytes", "resumed_requests", "peer_loads", "peer_load_failures",
            "publish_waits", "publish_waits_expired", "checkpoints_demoted", "peer_resumes", "peer_resume_misses",
            "handed_over_demoted", "sessions_ended", "sessions_ended_later", "session_end_demoted",
            "recalls", "recall_resumes")


@dataclass(slots=True)
class Resume:
    """Where a request resumes: state to hand the engine, and how it was had."""

    state: object | None  # what ``FlowEngine.generate`` imports (None: compute, or the engine loads itself)
    position: int  # prompt tokens reused
    source: str  # device | host | disk | peer | computed
    nbytes: int = 0  # bytes loaded
    seconds: float = 0.0  # load time
    failure: str = ""  # "load_deadline" | "load_failed": why a lookup or load gave nothing (NOTE 7)
    node_position: int = 0  # what the lookup found in this node's shared tiers (0: nothing), NOTE 5
    resident_blocks: int = 0  # leading full blocks the engine holds resident (NOTE 11)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """A store's resumable prefix: ``position`` tokens, the slowest tier it needs."""

    position: int
    tier: str | None


class FlowEngine(Protocol):
    """What the flow needs of an engine."""

    model_id: str
    block_size: int
    eos_token_id: int | None
    keeps_state: bool  # a finished request stays held for export until ``release`` (turn-end publish)

    def generate(self, request: EngineRequest, state: object | None = None) -> AsyncIterator[TokenOutput]: ...

    async def resident_length(self, tokens: list[int], cache_salt: str) -> int: ...

    async def resident_extent(self, tokens: list[int], cache_salt: str) -> tuple[int, int]: ...  # NOTE 11

    def live_requests(self) -> int: ...  # requests streaming now: the batch a local prefill stalls (NOTE 5)

    async def checkpoint_positions(self, request_id: str) -> list[int]: ...  # KeyError: not held

    async def computed_tokens(self, request_id: str) -> list[int]: ...  # KeyError: not held

    async def export_state(self, request_id: str, position: int | None = None, first_block: int = 0,
                           on_device: bool = False): ...

    async def export_and_release(self, request_id: str, positions: tuple[int, ...], present: int) -> list: ...

    async def release(self, request_id: str, keep_resident: bool = True) -> None: ...


class FlowState(Protocol):
    """What the flow needs of the node's state tiers. Calls may raise: the flow degrades (NOTE 3)."""

    async def lookup(self, tokens: list[int], hasher: BlockHasher, limit: int | None = None
                     ) -> ResumePoint | None: ...  # limit: furthest position asked (default: the last token's)

    async def load(self, tokens: list[int], position: int, hasher: BlockHasher, params: GenerateParams,
                   node_id: str | None = None, first_block: int = 0) -> Resume | None: ...  # NOTE 11

    async def open(self, handle: PrefillHandle, tokens: list[int], hasher: BlockHasher, params: GenerateParams,
                   release_fn: ReleaseFn | None, first_block: int = 0) -> Resume | None: ...

    async def publish(self, engine: FlowEngine, request_id: str, tokens: list[int], hasher: BlockHasher,
                      also_at: tuple[int, ...] = ()) -> tuple[int, tuple[int, ...]]:
        """Export the held request at ``len(tokens)`` and ``also_at``, release it (always, once
        called) and store the state: (bytes stored, positions whose every piece is stored)."""
        ...

    async def demote(self, points: list[PublishedPoint]) -> int:
        """Have the tiers evict these resume points' objects first (NOTE 9): how many of them
        some tier held."""
        ...

    async def recall(self, tokens: list[int], hasher: BlockHasher, from_position: int, timeout_s: float,
                     held_blocks: int = 0) -> ResumePoint | None:
        """Ask the node's other devices for the blocks of ``tokens`` past ``from_position``, wait
        up to ``timeout_s`` and look up again, the first ``held_blocks`` taken as this engine's
        (NOTE 16): the resume point then, None when nothing came back."""
        ...

    async def demote_blocks(self, node_id: str, hashes: list[bytes]) -> int:
        """Have node ``node_id``'s tiers (another node's, NOTE 12, or this node's, NOTE 13) evict
        the MLA blocks ``hashes`` first, the first first: how many of them it held."""
        ...


@dataclass(slots=True)
class FlowOptions:
    """The flow's settings, typed once (``from_config`` reads them from the app config)."""

    decider: DeciderConfig = field(default_factory=DeciderConfig)  # the P/D decision (NOTE 5)
    prefill_retries: int = 2  # remote prefill attempts after the first, then prefill here
    retry_backoff_s: float = 0.25  # pause before a retry (lets the router see a dead replica)
    load_deadline_s: float = 5.0  # a lookup + load past this recomputes (NOTE 3)
    publish_wait_s: float | None = None  # a lookup's wait for an in-flight publish (NOTE 8); None: load_deadline_s
    learned_checkpoints: bool = True  # prefills keep checkpoints where resumes were seen (NOTE 7)
    keep_checkpoints: int = KEEP_CHECKPOINTS  # a session's newest private checkpoints not demoted (NOTE 9); 0: off
    keep_turns: int | str = KEEP_TURNS  # ... nor its newest turns' (0: no limit; "auto": learned; NOTE 9)
    speculative_first: bool = False  # a local prefill's speculative checkpoints demoted as they land (NOTE 9)
    recall_s: float = 0.0  # a lookup's wait for node mates' devices to write back what it misses (NOTE 16); 0: off
    recall_costs: CostModel | None = None  # ... or longer, as long as computing it would take (NOTE 16)

    @classmethod
    def from_config(cls, app: AppConfig, **overrides) -> FlowOptions:
        """The options a Serve replica runs with: ``router`` (decider), ``transfer.load_deadline_s``,
        ``engine.learned_checkpoints``, ``transfer.host.keep_checkpoints``, ``keep_turns``,
        ``speculative_first`` and ``recall_ms`` (with ``victim``, priced by ``router.engine_profile``);
        ``overrides`` replace any field."""
        victim, profile = app.transfer.host.victim, app.router.engine_profile
        base = {"decider": DeciderConfig(**app.router.decider_params()),
                "load_deadline_s": app.transfer.load_deadline_s,
                "learned_checkpoints": app.engine.learned_checkpoints,
                "keep_checkpoints": app.transfer.host.keep_checkpoints,
                "keep_turns": app.transfer.host.keep_turns,
                "speculative_first": app.transfer.host.speculative_first,
                "recall_s": app.transfer.host.recall_ms / 1000 if victim else 0.0,
                "recall_costs": cost_profile(profile) if victim and profile else None}
        return cls(**{**base, **overrides})

    def recall_wait_s(self, new_tokens: int, context: int) -> float:
        """How long a recall of ``new_tokens`` past ``context`` waits (NOTE 16): ``recall_s``, or
        what the engine profile says computing them takes, when longer (0: recalls off)."""
        if self.recall_s <= 0:
            return 0.0
        if self.recall_costs is None:
            return self.recall_s
        return max(self.recall_s, self.recall_costs.prefill_time(new_tokens, context))


class RequestFlow:
    """The decode-side flow (module docstring) over one engine and one state.

    Args:
        engine: a ``FlowEngine``.
        state: a ``FlowState``, or None (no tiers: resume from the device or compute).
        replica_id: stamped on every chunk.
        options: ``FlowOptions`` (default: the defaults).
        prefill_pool: the prefill pool's loads and uncached tokens for a request (NOTE 5); None: unknown.
        node_id: this worker's node (its shared tiers are the pool's too on that node, NOTE 5).
        reuse: the reuse accounting (NOTE 7); default: accounting, with learned checkpoint
            placement when ``options.learned_checkpoints`` and session retention (NOTE 9)
            when ``options.keep_checkpoints`` > 0.
    """

    def __init__(self, engine: FlowEngine, state: FlowState | None, replica_id: str = "local",
                 options: FlowOptions | None = None, *, prefill_pool: PoolFn | None = None,
                 node_id: str | None = None, counters: dict[str, int] | None = None,
                 reuse: ReuseAccounting | None = None):
        self.engine = engine
        self.state = state
        self.replica_id = replica_id
        self.options = options or FlowOptions()
        self.decider = PDDecider(self.options.decider)
        self.prefill_pool = prefill_pool
        self.node_id = node_id
        placement = CheckpointPlacement(engine.block_size) if self.options.learned_checkpoints else None
        keep = self.options.keep_checkpoints
        retention = (SessionCheckpoints(engine.block_size, keep, keep_turns=self.options.keep_turns)
                     if keep > 0 else None)  # NOTE 9
        self.reuse = reuse or ReuseAccounting(engine.block_size, placement, retention=retention)  # NOTE 7
        self.counters = counters if counters is not None else dict.fromkeys(COUNTERS, 0)
        self.decisions: dict[str, int] = {}  # P/D decisions by the decider's reason (NOTE 5)
        self.unfinished = 0  # requests in this flow, not finished (the decider's "coming", NOTE 5)
        self.inbound = 0  # requests prefilling in the pool for this engine, or handing off (NOTE 15)
        self.inbound_tokens = 0  # their prompt tokens
        self._tasks: set[asyncio.Task] = set()  # background publishes
        self._publishing: dict[str, set[asyncio.Task]] = {}  # session -> its publishes in flight (NOTE 6)
        self._landing = asyncio.Event()  # set (and replaced) whenever a noted publish lands or drops (NOTE 8)

    # -- 1 plan ---------------------------------------------------------------------
    async def plan_resume(self, tokens: list[int], hasher: BlockHasher, params: GenerateParams) -> Resume:
        """The longest of the device-resident session and the tiers' resumable prefix (loaded)."""
        resident = self.engine.resident_extent(tokens, params.cache_salt)  # both lookups at once
        if self.state is None:
            device_len, _ = await resident
            return Resume(None, device_len, "device" if device_len else "computed")
        deadline = time.monotonic() + self.options.load_deadline_s  # lookup and load share one deadline
        lookup = asyncio.wait_for(self.state.lookup(tokens, hasher), self.options.load_deadline_s)
        extent, point = await asyncio.gather(resident, lookup, return_exceptions=True)
        if isinstance(extent, BaseException):
            raise extent
        device_len, blocks = extent
        failure = ""
        if isinstance(point, asyncio.TimeoutError):
            self.counters["load_timeouts"] += 1
            log.warning("state lookup passed its %.1f s deadline; recomputing", self.options.load_deadline_s)
            point, failure = None, "load_deadline"
        elif isinstance(point, Exception):  # a tier that fails is a miss (NOTE 3)
            self.counters["load_failures"] += 1
            log.error("state lookup failed; recomputing", exc_info=point)
            point, failure = None, "load_failed"
        elif isinstance(point, BaseException):  # cancelled: not a failure of the state path
            raise point
        node_position = point.position if point is not None else 0
        if self.options.recall_s > 0 and not failure:  # NOTE 16
            have = max(device_len, node_position, blocks * self.engine.block_size)
            if len(tokens) - 1 - have >= self.engine.block_size:
                point, node_position = await self._recall(tokens, hasher, have, blocks, deadline, point,
                                                          node_position)
        if params.state_position > max(device_len, node_position) and self._names_peer(params):  # NOTE 10
            got = await self.load(tokens, params.state_position, hasher, params, deadline,
                                  node_id=params.state_node, first_block=blocks)
            if not got.failure:
                self.counters["peer_resumes"] += 1
                return replace(got, source="peer", node_position=node_position, resident_blocks=blocks)
            self.counters["peer_resume_misses"] += 1  # what this node holds, within what is left of the deadline
        if point is not None and point.position > device_len:
            loaded = await self.load(tokens, point.position, hasher, params, deadline, first_block=blocks)
            if not loaded.failure:
                return replace(loaded, source=_source(point.tier), node_position=node_position,
                               resident_blocks=blocks)
            failure = loaded.failure
        return Resume(None, device_len, "device" if device_len else "computed", failure=failure,
                      node_position=node_position, resident_blocks=blocks)

    async def _recall(self, tokens: list[int], hasher: BlockHasher, have: int, blocks: int, deadline: float,
                      point: ResumePoint | None, node_position: int) -> tuple[ResumePoint | None, int]:
        """NOTE 16: the lookup again when node mates wrote back some of what it missed (the
        engine's ``blocks`` leading resident blocks count as present: the load skips them)."""
        budget = min(self.options.recall_wait_s(len(tokens) - have, have), deadline - time.monotonic())
        if budget <= 0:
            return point, node_position
        try:
            again = await asyncio.wait_for(self.state.recall(tokens, hasher, have, budget, blocks),
                                           max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return point, node_position
        except Exception:  # noqa: BLE001 - a recall that fails is a miss (NOTE 3)
            log.warning("recall from node mates failed", exc_info=True)
            return point, node_position
        if again is None:
            return point, node_position
        self.counters["recalls"] += 1
        if again.position > node_position:
            self.counters["recall_resumes"] += 1
            return again, again.position
        return point, node_position

    def _names_peer(self, params: GenerateParams) -> bool:
        """Whether ``params`` names another node's tiers to resume from (NOTE 10)."""
        return (bool(params.state_node) and params.state_node != self.node_id
                and 0 < params.state_position < len(params.prompt_token_ids))

    async def load(self, tokens: list[int], position: int, hasher: BlockHasher, params: GenerateParams,
                   deadline: float | None = None, node_id: str | None = None, first_block: int = 0) -> Resume:
        """The state at ``position`` within the deadline, without the rows of its first
        ``first_block`` blocks when the engine holds them (NOTE 11); on a miss a ``Resume`` without
        state that says why (recompute, NOTE 3)."""
        budget = self.options.load_deadline_s if deadline is None else deadline - time.monotonic()
        failure = "load_failed"
        first_block = min(first_block, position // self.engine.block_size)
        try:
            got = await asyncio.wait_for(self.state.load(tokens, position, hasher, params, node_id, first_block),
                                         max(0.0, budget))
        except asyncio.TimeoutError:  # a stalled tier or peer: recompute rather than wait
            self.counters["load_timeouts"] += 1
            log.warning("state load passed its %.1f s deadline; recomputing", self.options.load_deadline_s)
            got, failure = None, "load_deadline"
        except Exception:  # a tier that fails is a miss
            log.exception("state load failed; recomputing")
            got = None
        if got is None:
            self.counters["load_failures"] += 1
            return Resume(None, 0, "computed", failure=failure)
        return got

    # -- 2 decide -------------------------------------------------------------------
    def decide(self, plan: Resume, has_pool: bool, params: GenerateParams, ticket: ReuseTicket) -> PDDecision:
        """NOTE 5: the router's decider over the suffix after ``plan`` and the pool's view of
        ``params`` (``ticket``: its prompt's digests, hashed once)."""
        suffix_tokens = len(params.prompt_token_ids) - plan.position
        if not has_pool:
            loads, uncached = [], None
        else:
            view = self.pool_view(PoolQuery(params, ticket.hasher, ticket.hashes, self.node_id, plan.node_position))
            loads, uncached = (view.loads, view.uncached) if view is not None and view.loads else ([0.0], None)
        running = self.engine.live_requests()
        # running: every request streaming on the engine, prefilling ones too (the decider's Q_d is in it)
        decision = self.decider.decide(suffix_tokens, loads, pool_uncached=uncached, decode_batch=running,
                                       decode_coming=max(running, self.unfinished - 1),  # the asking one aside
                                       first_turn=params.first_turn)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1
        return decision

    def inbound_change(self, n: int, tokens: int) -> None:
        """NOTE 15: ``n`` requests of ``tokens`` prompt tokens each start (1) or stop (-1) being
        on their way to this engine's batch."""
        self.inbound += n
        self.inbound_tokens += n * tokens
        assert self.inbound >= 0 and self.inbound_tokens >= 0, "negative inbound decodes"

    def routing_load(self) -> dict[str, int]:
        """What this flow adds to its replica's load report (NOTE 15)."""
        return {"inbound_decode_requests": self.inbound, "inbound_decode_tokens": self.inbound_tokens}

    def pool_view(self, query: PoolQuery) -> PoolView | None:
        """The prefill pool as ``prefill_pool`` sees it for ``query``; None: unknown, or the view
        failed (logged: the decision then goes without it, NOTE 5)."""
        if self.prefill_pool is None:
            return None
        try:
            return self.prefill_pool(query)
        except Exception:  # noqa: BLE001 - a decision without the pool's figures, not a failed request
            log.warning("prefill pool view failed; deciding without it", exc_info=True)
            return None

    # -- 3 remote prefill ---------------------------------------------------------------
    async def remote_prefill(self, params: GenerateParams, prefill_fn: PrefillFn) -> PrefillHandle | None:
        """A prefill replica's handle, retried with backoff; None: prefill here."""
        for attempt in range(self.options.prefill_retries + 1):
            try:
                return await prefill_fn(params)
            except Exception as exc:  # a dead or failing prefill replica: retry, then prefill here
                self.counters["prefill_failures"] += 1
                log.warning("remote prefill attempt %d failed (%s)", attempt + 1, exc)
                if attempt < self.options.prefill_retries:
                    await asyncio.sleep(self.options.retry_backoff_s * (attempt + 1))
        return None

    # -- the decode-side flow -------------------------------------------------------------
    async def generate(self, params: GenerateParams, hasher: BlockHasher, prefill_fn: PrefillFn | None = None,
                       release_fn: ReleaseFn | None = None) -> AsyncIterator[StreamChunk]:
        """Stream one request's chunks. ``hasher`` carries the request's cache salt;
        ``release_fn(handle)`` tells a prefill replica its device hand-off was copied."""
        self.unfinished += 1  # NOTE 5: until this request ends, whatever way it ends
        try:
            session = session_key(params.cache_salt, params.session_id)
            pending = self._publishing.get(session) if session else None
            if pending:  # NOTE 6
                await asyncio.wait(list(pending), timeout=self.options.load_deadline_s)
            tokens = list(params.prompt_token_ids)
            self.counters["resumed_requests"] += int(params.resumed_output_tokens > 0)
            ticket = self.reuse.begin(tokens, hasher, params.session_id, params.request_id, params.cache_salt,
                                      params.checkpoint_back)  # reuse
            try:
                async with aclosing(self._generate(params, hasher, prefill_fn, release_fn, ticket)) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:  # reuse: a request that ends without a publish to come drops what it noted (NOTE 8)
                if not ticket.settled and not ticket.publishing:
                    self.settle(ticket, ())
        finally:
            self.unfinished -= 1

    async def _generate(self, params: GenerateParams, hasher: BlockHasher, prefill_fn: PrefillFn | None,
                        release_fn: ReleaseFn | None, ticket: ReuseTicket) -> AsyncIterator[StreamChunk]:
        tokens = list(params.prompt_token_ids)
        sampling = params.sampling
        await self.await_publishes(ticket)  # NOTE 8
        plan = await self.plan_resume(tokens, hasher, params)  # resume planned
        points = self.reuse.checkpoint_at(ticket, plan.position)  # reuse: where the prefill keeps checkpoints
        decision = self.decide(plan, prefill_fn is not None, params, ticket)  # decision taken
        handle = None
        inbound = len(tokens) if decision.disaggregate else 0  # NOTE 15: on its way to this engine's batch
        if inbound:
            self.inbound_change(1, inbound)
        try:
            if decision.disaggregate:
                named = {"state_node": self.node_id, "state_position": plan.node_position} \
                    if self.node_id and plan.node_position > 0 and plan.node_position >= params.state_position \
                    else {}  # NOTE 10: this node, unless the router named one holding more
                handle = await self.remote_prefill(replace(params, checkpoint_at=points, decode_node=self.node_id,
                                                           **named), prefill_fn)
            first_index = params.resumed_output_tokens  # NOTE 4
            reported = None  # (cached, source) of the prefill replica, when one ran (NOTE 2)
            if handle is None:
                self.counters["local_prefills"] += 1
                self.unpend(ticket)  # NOTE 8: its points land with its turn end, after the whole decode
            else:
                self.counters["remote_prefills"] += 1
                reported = handle.num_cached_tokens, handle.cached_source
                await self.reuse_finish(ticket, reported[0], handle.resume_failure, params)  # reuse: misses
                self.settle(ticket, handle.checkpoints)  # reuse: the prefill's publishes
                superseded = self.superseded(session_key(params.cache_salt, params.session_id), params.request_id,
                                             ticket.tokens, hasher, handle.checkpoints, ticket.hashes)  # NOTE 9
                if superseded:
                    self.spawn(self.demote(superseded))
                first = StreamChunk([handle.first_token], num_prompt_tokens=len(tokens), num_cached_tokens=reported[0],
                                    cached_source=reported[1], replica_id=self.replica_id,
                                    logprobs=[handle.first_logprob] if handle.first_logprob is not None else None)
                going_on = False
                try:
                    stop = _is_stop(handle.first_token, sampling, self.engine.eos_token_id)
                    if stop or sampling.max_tokens == 1:  # a stop token outranks the length (as in the engine)
                        first.finished, first.finish_reason = True, "stop" if stop else "length"
                        first.reuse_misses, first.reuse_bound = ticket.misses, ticket.bound
                        if params.session_end:  # NOTE 13 (nothing held here: the hand-off was not loaded)
                            self._end_session(params, ticket, None)
                        yield first
                        return
                    yield first
                    going_on = True
                finally:  # done, or closed after the first token: a device hand-off is released unopened
                    if not going_on and handle.device_state is not None and release_fn is not None:
                        self.spawn(_quietly(release_fn(handle), f"device hand-off {handle.device_state.share_id}"))
                plan = await self.open(handle, tokens, hasher, params, release_fn, plan.resident_blocks)  # load result
                if plan.state is not None and handle.device_state is None and handle.node_id not in ("", self.node_id):
                    self.spawn(self.hand_over(handle.node_id, ticket))  # NOTE 12
                tokens = tokens + [handle.first_token]
                sampling = replace(sampling, max_tokens=sampling.max_tokens - 1)
                first_index += 1
        finally:
            if inbound:  # the decode goes to the engine next, or the request ended
                self.inbound_change(-1, inbound)
        local_points = () if handle is not None else tuple(p for p in points if p > plan.position)
        async for chunk in self.decode(params, tokens, sampling, plan, first_index, hasher, reported, ticket,
                                       local_points):
            yield chunk

    async def open(self, handle: PrefillHandle, tokens: list[int], hasher: BlockHasher, params: GenerateParams,
                   release_fn: ReleaseFn | None, resident_blocks: int = 0) -> Resume:
        """The prefill's state by handle (within the deadline), without the rows of the
        ``resident_blocks`` the engine holds (NOTE 11), or a recompute from scratch (NOTE 3)."""
        if self.state is None:  # nowhere to load from
            self.counters["load_failures"] += 1
            return Resume(None, 0, "computed")
        first_block = min(resident_blocks, handle.position // self.engine.block_size)
        opening = self.state.open(handle, tokens, hasher, params, release_fn, first_block)
        try:  # a device hand-off is one peer copy (no deadline); a tier load has the load deadline
            got = await (opening if handle.device_state is not None
                         else asyncio.wait_for(opening, self.options.load_deadline_s))
        except asyncio.TimeoutError:
            self.counters["load_timeouts"] += 1
            log.warning("hand-off load passed its %.1f s deadline; recomputing", self.options.load_deadline_s)
            got = None
        except Exception:
            log.exception("hand-off load failed; recomputing")
            got = None
        if got is None:
            self.counters["load_failures"] += 1
        return got or Resume(None, 0, "computed")

    # -- 4 decode, 5 turn end ----------------------------------------------------------
    async def decode(self, params: GenerateParams, tokens: list[int], sampling: SamplingParams, plan: Resume,
                     first_index: int, hasher: BlockHasher, reported: tuple[int, str] | None,
                     ticket: ReuseTicket, checkpoint_at: tuple[int, ...] = ()) -> AsyncIterator[StreamChunk]:
        """Run the engine from ``plan``; ``reported`` is set when a prefill replica computed the
        prompt, else this prefill keeps checkpoints at ``checkpoint_at`` (NOTE 7)."""
        rid = f"{params.request_id}/decode"
        keep = self.engine.keeps_state
        req = EngineRequest(rid, tokens, sampling, keep_state=keep, first_output_index=first_index,
                            cached_source=plan.source, cache_salt=params.cache_salt, checkpoint_at=checkpoint_at,
                            save_state=not params.session_end)  # NOTE 13
        n_prompt = len(params.prompt_token_ids)
        first = True
        # wall time (the replica's reports are stamped so) from which its engine counts it as a decode, not
        # an inbound one (NOTE 15) or a queued prefill: prefilled in the pool, from here; else its first output
        decode_from = time.time() if reported is not None else 0.0
        try:
            async with aclosing(self.engine.generate(req, plan.state)) as outs:  # closing aborts the request
                async for out in outs:
                    if first and reported is None:  # reuse: misses of the local prefill
                        decode_from = time.time()
                        await self.reuse_finish(ticket, out.num_cached_tokens, plan.failure, params)
                    first = False
                    cached, source = reported or (out.num_cached_tokens, out.cached_source)
                    if out.finished and params.session_end and out.finish_reason in ("length", "stop"):
                        self._end_session(params, ticket, rid if keep else None)  # NOTE 13
                    elif out.finished and keep and out.finish_reason in ("length", "stop"):
                        session = session_key(params.cache_salt, params.session_id) or None
                        mine = ticket if reported is None else None  # a local prefill's points land with it
                        if mine is not None:
                            mine.publishing = True
                        self.spawn(self.publish_turn_end(rid, hasher, mine, session, params.request_id),
                                   session)  # off the response path
                    chunk = StreamChunk(out.new_token_ids, out.finished, out.finish_reason, n_prompt, cached, source,
                                        out.error, plan.nbytes, plan.seconds, self.replica_id, logprobs=out.logprobs)
                    if out.finished:
                        chunk.reuse_misses, chunk.reuse_bound = ticket.misses, ticket.bound
                        chunk.served = (decode_from, time.time())
                    yield chunk
        finally:  # an unfinished request was aborted when ``outs`` closed (async_engine NOTE 4)
            self.counters["decodes"] += 1

    async def publish(self, request_id: str, tokens: list[int], hasher: BlockHasher,
                      also_at: tuple[int, ...] = ()) -> tuple[int, float, tuple[int, ...]]:
        """Publish a held request's state at ``len(tokens)`` (and at ``also_at``) and release it:
        (bytes stored, seconds, positions whose every piece is stored)."""
        t0 = time.perf_counter()
        nbytes, stored = 0, ()
        try:
            if self.state is None:
                await self.engine.release(request_id)
            else:  # the state releases the request (``FlowState.publish``)
                nbytes, stored = await self.state.publish(self.engine, request_id, tokens, hasher, also_at)
                self.counters["published_bytes"] += nbytes
        except Exception:
            log.exception("publishing state failed; the next turn will recompute")
        finally:
            self.reuse.published(tokens, hasher, stored)  # reuse: published
            self._landed()
        return nbytes, time.perf_counter() - t0, stored

    def settle(self, ticket: ReuseTicket, stored: tuple[int, ...]) -> None:
        """The ticket's publishes are over (NOTE 8): ``stored`` landed, the rest will not."""
        self.reuse.settle(ticket, stored)
        self._landed()

    def unpend(self, ticket: ReuseTicket) -> None:
        """A local prefill's points land only with its turn-end publish: no waiter waits for that."""
        self.reuse.dropped(ticket.tokens, ticket.hasher, ticket.pending)
        self._landed()

    def _landed(self) -> None:
        landing, self._landing = self._landing, asyncio.Event()
        landing.set()

    async def await_publishes(self, ticket: ReuseTicket) -> None:
        """NOTE 8: wait (bounded) for in-flight publishes of points past the prompt's published ones."""
        awaited = self.reuse.awaited(ticket)
        if not awaited:
            return
        wait_s = self.options.load_deadline_s if self.options.publish_wait_s is None else self.options.publish_wait_s
        deadline = time.monotonic() + wait_s
        while self.reuse.still_pending(ticket, awaited):
            left = deadline - time.monotonic()
            if left <= 0:
                self.counters["publish_waits_expired"] += 1
                return
            try:
                await asyncio.wait_for(self._landing.wait(), left)
            except asyncio.TimeoutError:
                pass
        self.counters["publish_waits"] += 1

    async def reuse_finish(self, ticket: ReuseTicket, realized: int, failure: str, params: GenerateParams) -> None:
        """NOTE 7: classify the prompt tokens this request recomputed; ``held`` probes whether a
        published resume point is still there (this engine's resident sessions, or the tiers)."""
        tokens, hasher = ticket.tokens, ticket.hasher

        async def held(position: int) -> bool:
            device = await self.engine.resident_length(tokens, params.cache_salt)
            if device >= position or self.state is None:
                return device >= position
            point = await self.state.lookup(tokens, hasher, position)
            return point is not None and point.position >= position

        await self.reuse.finish(ticket, realized, failure, held)

    async def publish_turn_end(self, request_id: str, hasher: BlockHasher, ticket: ReuseTicket | None = None,
                               session: str | None = None, turn: str = "") -> None:
        """Publish a finished request's turn end and its earlier checkpoints; ``ticket``: the
        request's own prefill ran here, and this publish settles its points (NOTE 8); ``session``:
        the request's session, whose superseded checkpoints are then demoted, ``turn`` the
        request's id (NOTE 9)."""
        stored: tuple[int, ...] = ()
        try:
            computed = await self.engine.computed_tokens(request_id)
            positions = await self.engine.checkpoint_positions(request_id)
        except KeyError:  # the engine no longer holds the request (it failed or was aborted)
            log.warning("turn end of %s not published: the engine no longer holds it", request_id)
        else:
            _, _, stored = await self.publish(request_id, computed, hasher,
                                              earlier_checkpoints(positions, len(computed)))
        finally:
            if ticket is not None:
                self.settle(ticket, stored)
        if stored:  # part of this (background) publish: the session's next turn waits for it (NOTE 6)
            await self.demote(self.superseded(session, turn or request_id, computed, hasher, stored,
                                              speculative=self._speculative(ticket)))  # NOTE 9

    def _speculative(self, ticket: ReuseTicket | None) -> tuple[int, ...]:
        """NOTE 9: the ticket's speculative points, to demote with its turn's, under ``speculative_first``."""
        return ticket.speculative if ticket is not None and self.options.speculative_first else ()

    def superseded(self, session: str | None, turn: str, tokens: list[int], hasher: BlockHasher,
                   stored: tuple[int, ...], hashes: list[bytes] | None = None,
                   speculative: tuple[int, ...] = ()) -> list[PublishedPoint]:
        """NOTE 9: ``session``'s points at ``stored`` (published by request ``turn``) landed: its
        points superseded now, and its private ones at ``speculative`` (the start prior's)."""
        if self.state is None or not stored:
            return []
        return self.reuse.superseded(session, turn, tokens, hasher, stored, hashes or None, speculative)

    async def demote(self, points: list[PublishedPoint]) -> None:
        """NOTE 9: the tiers evict ``points`` first; a failure only leaves eviction by recency."""
        if not points:
            return
        try:
            await self.state.demote(points)
        except Exception:  # noqa: BLE001 - a demote that fails leaves eviction by recency (NOTE 3)
            log.warning("demoting %d superseded checkpoints failed", len(points), exc_info=True)
            return
        self.counters["checkpoints_demoted"] += len(points)

    async def hand_over(self, node_id: str, ticket: ReuseTicket) -> None:
        """NOTE 12: the prompt's state, loaded from ``node_id``, lives here now: that node's tiers
        evict its private blocks first, the end of the context first; a failure leaves recency."""
        blocks = self._private_blocks(ticket)
        if not blocks or self.state is None:
            return
        try:
            n = await self.state.demote_blocks(node_id, blocks[::-1])
        except Exception:  # noqa: BLE001 - a demote that fails leaves eviction by recency (NOTE 3)
            log.warning("demoting %d handed-over blocks on node %s failed", len(blocks), node_id, exc_info=True)
            return
        self.counters["handed_over_demoted"] += n

    def _private_blocks(self, ticket: ReuseTicket) -> list[bytes]:
        """The digests of the prompt's full blocks past what another session also sent (NOTE 12)."""
        return ticket.hashes[self.reuse.shared_blocks(ticket):len(ticket.tokens) // self.engine.block_size]

    def _end_session(self, params: GenerateParams, ticket: ReuseTicket, held: str | None) -> None:
        """NOTE 13: the request ends its session; ``held``: the engine request to release."""
        session = session_key(params.cache_salt, params.session_id)
        if not session:  # the API refuses session_end without a session: nothing to end
            return
        self.spawn(self.end_session(session, ticket, held), session)

    async def end_session(self, session: str, ticket: ReuseTicket, held: str | None = None) -> None:
        """NOTE 13: ``session`` will not come back: release ``held`` without keeping it resident,
        then this node's tiers evict the session's private checkpoints and the prompt's private
        MLA blocks first (the end of the context first); a failure leaves eviction by recency."""
        self.counters["sessions_ended"] += 1
        if held is not None:
            try:
                await self.engine.release(held, keep_resident=False)
            except Exception:  # noqa: BLE001 - the engine expires what it holds; nothing to publish
                log.warning("releasing the last turn %s failed", held, exc_info=True)
        await self._demote_ended(session, self._private_blocks(ticket))

    async def end_session_by_id(self, session_id: str, cache_salt: str = "") -> int:
        """NOTE 14: the tenant's session ``session_id`` is over: this node's tiers evict what this
        worker saw of it first. Returns how many objects they held."""
        session = session_key(cache_salt, session_id)
        if not session:
            return 0
        self.counters["sessions_ended_later"] += 1
        return await self._demote_ended(session, self.reuse.private_blocks(session))

    async def _demote_ended(self, session: str, blocks: list[bytes]) -> int:
        """An ended session's checkpoints its retention tracks, then ``blocks`` (context order)
        end first, evicted first on this node (NOTE 13, 14); a failure leaves eviction by recency."""
        points = self.reuse.end_session(session)
        if self.state is None:
            return 0
        n = 0
        try:
            if points:
                n += await self.state.demote(points)
            if blocks:
                n += await self.state.demote_blocks(self.node_id or "", blocks[::-1])
        except Exception:  # noqa: BLE001 - a demote that fails leaves eviction by recency (NOTE 3)
            log.warning("demoting the state of an ended session failed", exc_info=True)
        self.counters["session_end_demoted"] += n
        return n

    # -- background work ---------------------------------------------------------------
    def spawn(self, coro, session: str | None = None) -> None:
        """Run ``coro`` in the background (a publish of ``session`` when named, NOTE 6)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if session is not None:
            group = self._publishing.setdefault(session, set())
            group.add(task)

            def done(t, key=session):
                group.discard(t)
                if not group:
                    self._publishing.pop(key, None)

            task.add_done_callback(done)

    async def drain(self) -> None:
        """Wait for background publishes (graceful shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def store_lookup(store, tokens: list[int], hasher: BlockHasher, limit: int | None = None) -> ResumePoint | None:
    """A ``kv_transfer`` store's resumable prefix of ``tokens`` up to ``limit`` (default: the last
    token's position), off the event loop; None without a store (``FlowState.lookup`` of both workers)."""
    if store is None:
        return None
    limit = len(tokens) - 1 if limit is None else limit
    point = await asyncio.to_thread(store.resumable_length, tokens, hasher, limit)
    return None if point is None else ResumePoint(point.position, point.slowest_tier)


def earlier_checkpoints(positions: list[int], end: int) -> tuple[int, ...]:
    """Checkpoint positions before ``end``, longest first (later publishes share its blocks)."""
    return tuple(sorted((p for p in positions if p < end), reverse=True))


def _source(tier: str | None) -> str:
    """Metric source name of a tier: host, disk, or peer for any remote tier."""
    if tier is None:
        return "computed"
    return "peer" if tier.startswith("remote") else tier


def _is_stop(token: int, sampling: SamplingParams, eos_token_id: int | None) -> bool:
    return token in sampling.stop_token_ids or (not sampling.ignore_eos and token == eos_token_id)


async def _quietly(work, what: str) -> None:
    """Await ``work``, logging instead of raising (clean-ups spawned off a closing request)."""
    try:
        await work
    except Exception:  # noqa: BLE001 - the owner expires what is left (device_ipc NOTE 1)
        log.warning("%s failed", what, exc_info=True)
