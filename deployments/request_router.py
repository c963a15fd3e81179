"""Serve request routers: the state-aware policy core behind Ray Serve's hook.

``StateAwareRequestRouter`` is a thin adapter: it turns the pending request's
``GenerateParams`` into a ``RouteRequest`` (chained block digests of the prompt
under the tenant's salt: digests, never tokens), the candidate replicas'
``routing_stats`` into ``WorkerState``s and the prefix index's device tier,
then asks ``disagg.router.StateAwareRouter`` (the same code the simulator
runs) and returns Serve's ranked tiers: the pick first (a few times where it
holds the prompt's state), then the rest by score, so Serve falls back down
the list when the pick is full, late to answer or gone (NOTE 1).

What each replica reports (``record_routing_stats``, every
``request_routing_stats_period_s``): role, node, load figures, and a snapshot
of its device-resident sessions as block digests (the newest snapshot
replaces the previous one in the index, see ``DeviceSnapshots``). A resident
session resumes at its turn end. Without more, the index is told about its
last full block; a replica that also reports ``device_tails`` (per session,
``[position, tail digest hex]`` of an unaligned turn end, or null) gets the
session credited up to that position: the index stores the tail and its
checkpoint, and each request probes the reported turn ends its own prompt
passes through (``DeviceSnapshots.tail_probes``).

The node-shared tiers reach the index as events: ``NodeEventFeed`` drains each
node's ``NodeStoreActor`` event log (host tier stores and evictions, disk
write-behind) in the background, at most every ``node_events_period_s``, into
the same index (the events name the node, so every replica of the node can
read what they report). Draining empties the log, so one router per node
store must own it: the router of the decode deployment (its replicas report
role "decode") does; the prefill deployment's routers, inside the decode
replicas, do not.

Replicas report their real role: "prefill", "decode" (a decode replica with a
prefill pool) or "both" (aggregated: it prefills everything). A router sees one
deployment's replicas, so it places within that pool (``disagg.router.router``
step 3c); the P/D decision is the decode worker's (``disagg.flow`` NOTE 5),
with the prefill pool as this process's prefill-deployment router sees it
(``prefill_pool_view``: per replica its effective loads and the request's
uncached tokens, by the same index walk that places the prefill, plus what the
asking decode replica's lookup found in its node's shared tiers for the pool's
replicas on that node, whose events this router does not drain): the same
figures, and the same ``PDDecider``, the simulator routes with. Decode replicas
also report their prefill pool's nodes (``prefill_nodes``, as their process's
prefill router knows them): the decode profile costs a hand-off to a replica on
one of those nodes over the host link, as the simulator's router does.

``AffinityRequestRouter`` is the simple baseline (rendezvous hashing of the
session id, load-ordered fallback). Requests that carry no ``GenerateParams``
(stats, health) go anywhere.

Config (``router:`` in the app YAML): by default every pool places by the router's default
profiles (``disagg.router.registry.DEFAULT_PROFILES``, what the simulator runs); ``weights``
replaces every profile's scorers::

    router: {policy: state_aware, weights: {prefix: 2.0, load: 1.0, affinity: 0.5}}
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from ray.serve.request_router import RequestRouter

import disagg.router.metrics as router_metrics
from deployments.node_store import node_store_actor_of
from disagg.messages import GenerateParams, PrefillHandle, SessionEnd, ToReplica
from disagg.router.index import IndexUpdate, PrefixIndex
from disagg.router.match import credit_node_state
from disagg.router.metrics import PoolQuery, PoolView
from disagg.router.router import RouterConfig, StateAwareRouter
from disagg.router.types import RouteDecision, RouteRequest, TailProbe, WorkerState
from disagg.session import session_key
from kv_transfer.keys import BlockHasher, KeyExtras

log = logging.getLogger("ray.serve")

# NOTE 1: how Serve uses the ranks. Serve sends a request to the first replica of a rank that
# answers its queue-length probe in time with room to spare: 0.1 s for a first round
# (RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S), doubled each round that found none, up to 1 s. A
# replica whose event loop is busy answers late (a decode replica computing on a loaded 2-core
# machine did), and one rank is all Serve tried before the next: a session sent away from its
# device state recomputes its context there. So the pick that holds the prompt's state gets
# ``STATE_PROBE_ROUNDS`` rounds before the rest: up to 0.1 + 0.2 + 0.4 + 0.8 = 1.5 s with Serve's
# defaults for a late pick, a few quick probes for a full one. A request Serve ran elsewhere all
# the same is counted (``report_finished``, ``disagg_route_overridden``).
# When no rank took the request, Serve asks again, after a backoff (``should_backoff``); the
# request was booked by the policy once (its predicted loads, its session's worker), so it gets
# the same ranks while its pick is a candidate (the placement rides on Serve's pending request),
# and is placed anew, its booking dropped, once the pick is gone.
# A replica found goes to the request it was found for (``_OwnReplicas``). Serve's FIFOMixin gave it
# to the oldest pending request, which handed one request's pick to another whenever a later
# request's probe answered first. Serve's own matching, by internal request id, does not tell
# apart calls that share one: the calls a request makes inherit its id, and the ingress's
# per-replica calls (stats, a session's end) go out together, so all but one waited forever.
# NOTE 2: what a decode pool's router knows of its prefill pool when it places. The decode
# scorer charges a candidate the stall a local prefill of the request would cause its batch only
# where the P/D decider would take the request local there (``disagg.router.scorers.decode``).
# One local rule reads the decode worker alone; the others read the prefill pool's loads and what
# each of its replicas could not resume (``PDDecider.local_mask``). With ``harm_pool_view`` the
# decode pool's router asks this process's router of the prefill deployment (``prefill_pool``,
# set by ``deployments.app`` on the decode deployment) for that view, as a decode replica asks its
# own before it decides (``disagg.flow`` NOTE 5). The ingress holds one: it initializes its
# prefill handle at start (``deployments.ingress``). Two differences from the decider's view:
# the ingress routes no prefill, so its router books none in flight (the replicas' reported
# queues still count), and the query names no node, so a pool replica on a candidate's node is
# not credited with what that node's shared tiers hold.
STATE_PROBE_ROUNDS = 4
_PLACED = "_disagg_placed"  # the pending request's placement: its RouteDecision, or None (no pick)
_UNPLACED = object()


def report_finished(request_id: str, realized_cached_tokens: int | None, output_tokens: int | None = None,
                    served: tuple[float, float] | None = None, replica: str = "") -> None:
    """Tell this process's policies how many cached tokens a routed request really reused (None: it
    ended without a result; they drop its bookkeeping), how many tokens it generated (what
    the state-aware router learns to expect of a session's next turn, ``disagg.router.outputs``),
    ``served``: the replica's wall times from which it counted as a decode and of its end
    (``StreamChunk.served``), put on each policy's clock as the replica's reports are (``_sync``),
    so reports taken before its end stop counting it (``disagg.router.loads`` NOTE 6), and the
    replica that ran it (counted where Serve overrode the pick; "": not known)."""
    for policy in list(router_metrics.LIVE_POLICIES.values()):
        policy.on_finished(request_id, realized_cached_tokens, output_tokens, _on_clock(policy, served),
                           replica or None)


def prefill_finished(deployment: str, request_id: str, handle: PrefillHandle | None) -> None:
    """A remote prefill this process sent to ``deployment`` returned ``handle`` (None: the call
    failed): that pool's router here forgets the request, with the cached tokens it reused and,
    from ``handle.computed_at``, no longer counts it in reports the prefill replica took before
    its prompt was computed (``disagg.router.loads`` NOTE 6). Without this, each prefill routed
    from a decode replica stayed in that router's books for the replica's life."""
    policy = router_metrics.POOL_POLICIES.get(deployment)
    if policy is None:
        return
    if handle is None:
        policy.on_finished(request_id, None)
        return
    t = handle.computed_at
    policy.on_finished(request_id, handle.num_cached_tokens, None, _on_clock(policy, (t, t)) if t else None)


def _on_clock(policy, served: tuple[float, float] | None) -> tuple[float, float] | None:
    """A replica's wall stamps of a request put on ``policy``'s clock (``_wall_to_clock``)."""
    return None if served is None else (_wall_to_clock(policy, served[0]), _wall_to_clock(policy, served[1]))


def _wall_to_clock(policy, wall: float) -> float:
    """A replica's wall time on ``policy``'s clock: as long ago as it is now (never in the future)."""
    return policy.clock() - max(0.0, time.time() - wall)


def router_stats() -> dict:
    """Decisions by reason, predicted vs realized cached tokens and the requests Serve ran elsewhere
    than routed, summed over this process's policies."""
    reasons: dict[str, int] = {}
    predicted = realized = overridden = 0
    views: dict[str, int] = {}
    for policy in list(router_metrics.LIVE_POLICIES.values()):
        snap = policy.metrics.snapshot()
        for reason, n in snap["decisions"].items():
            reasons[reason] = reasons.get(reason, 0) + n
        for outcome, n in snap["pool_views"].items():
            views[outcome] = views.get(outcome, 0) + n
        predicted += snap["predicted_cached_tokens"]
        realized += snap["realized_cached_tokens"]
        overridden += snap["overridden"]
    return {"route_decisions": reasons, "route_predicted_cached_tokens": predicted,
            "route_realized_cached_tokens": realized, "route_overridden": overridden, "route_pool_views": views}


_POOL_ROLES = ("prefill", "decode", "both")


def prefill_pool_view(deployment: str, query: PoolQuery) -> PoolView | None:
    """``deployment``'s loads and, for the query's prompt, each replica's uncached tokens, as this
    process's router of that deployment sees them (``StateAwareRequestRouter.pool_view``); None
    before that router exists (no request sent yet) or when it has no replica."""
    view = router_metrics.POOL_VIEWS.get(deployment)
    return None if view is None else view(query)


def _params(pending_request) -> GenerateParams | None:
    if pending_request is None or not pending_request.args:
        return None
    p = pending_request.args[0]
    return p if isinstance(p, GenerateParams) else None


def _session_end(pending_request) -> SessionEnd | None:
    if pending_request is None or not pending_request.args:
        return None
    p = pending_request.args[0]
    return p if isinstance(p, SessionEnd) else None


def _named(pending_request) -> str | None:
    """The replica a call names (a ``ToReplica``'s); None: the call names none."""
    if pending_request is None or not pending_request.args:
        return None
    p = pending_request.args[0]
    return p.replica if isinstance(p, ToReplica) else None


def _to_named(candidate_replicas, replica: str) -> list:
    """A call for one replica (a session's end: each is told once, ``disagg.flow`` NOTE 14; the
    ingress's stats) goes to the one named; one not among the candidates (gone, or none named): any."""
    named = [r for r in candidate_replicas if r.replica_id.unique_id == replica]
    return [named] if named else [candidate_replicas]


def _register_replicas(router) -> None:
    """Publish ``router``'s replica ids and their nodes under its deployment's name
    (``router_metrics.REPLICA_IDS``, ``REPLICA_NODES``)."""
    deployment = getattr(getattr(router, "_deployment_id", None), "name", None)
    if deployment:
        router_metrics.REPLICA_IDS[deployment] = lambda: [r.replica_id.unique_id for r in
                                                          list(router.curr_replicas.values())]
        router_metrics.REPLICA_NODES[deployment] = lambda: sorted(
            {n for r in list(router.curr_replicas.values()) if (n := (r.routing_stats or {}).get("node_id"))})


def replica_ids(deployment: str) -> list[str]:
    """The replicas of ``deployment`` this process's router of it knows ([]: none yet)."""
    ids = router_metrics.REPLICA_IDS.get(deployment)
    return ids() if ids is not None else []


def replica_nodes(deployment: str) -> list[str]:
    """The nodes ``deployment``'s replicas report, as this process's router of it knows them, sorted
    ([]: none yet)."""
    nodes = router_metrics.REPLICA_NODES.get(deployment)
    return nodes() if nodes is not None else []


class NodeEventFeed:
    """Drains node stores' ``StoreEvent``s (host and disk tiers) into a prefix index.

    ``watch`` names a node once one of its replicas has been registered in the
    index (the events are reported by the node id); ``poll`` starts a
    background drain when ``period_s`` has passed since the last one, so a
    routing decision never waits on a remote call.
    """

    def __init__(self, index: PrefixIndex, period_s: float = 1.0,
                 lookup: Callable[[str], Any | None] = node_store_actor_of):
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self._index = index
        self._period_s = period_s
        self._lookup = lookup
        self._actors: dict[str, Any | None] = {}  # node id -> its node store handle (None: not found yet)
        self._task: asyncio.Task | None = None
        self._last = float("-inf")  # monotonic time of the last drain started
        self.num_events = 0  # events applied to the index

    def watch(self, node_id: str) -> None:
        if node_id and node_id not in self._actors:
            self._actors[node_id] = None

    def poll(self) -> None:
        now = time.monotonic()
        if self._actors and now - self._last >= self._period_s and (self._task is None or self._task.done()):
            self._last = now
            self._task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> int:
        """Apply every watched node's pending events; returns how many."""
        n = 0
        for node_id, actor in list(self._actors.items()):
            if actor is None:  # a GCS lookup: off the event loop
                actor = self._actors[node_id] = await asyncio.to_thread(self._lookup, node_id)
                if actor is None:
                    continue
            try:
                events = await actor.take_events.remote()
            except Exception as exc:  # the node store went away: look it up again next time
                log.warning("node store of %s: events unavailable (%s)", node_id[:12], exc)
                self._actors[node_id] = None
                continue
            self._index.apply_many(events)
            n += len(events)
        self.num_events += n
        return n


class DeviceSnapshots:
    """Replicas' device-resident sessions in a prefix index, turn ends included.

    ``apply`` replaces a replica's device tier with a snapshot: each session's
    block digests (MLA blocks; KDA checkpoints at the full-block counts it
    reports, else one at the last full block) and, when reported, its unaligned
    turn end (tail + checkpoint at the tail digest).
    ``tail_probes`` lists the turn ends a prompt passes through (same parent
    block, position inside the prompt), the probes the walk needs to credit
    them; it costs one dict lookup per distinct reported position.
    """

    def __init__(self, index: PrefixIndex):
        self._index = index
        self._ends: dict[str, set[tuple[int, bytes]]] = {}  # replica -> {(turn-end position, tail digest)}
        self._by_pos: dict[int, dict[bytes, int]] = {}  # position -> tail digest -> replicas reporting it

    def apply(self, worker_id: str, sessions: list[list[str]], tails: list | None = None,
              checkpoints: list | None = None) -> None:
        idx = self._index
        idx.remove_worker_objects(worker_id)
        for pos, tail in self._ends.pop(worker_id, ()):
            left = self._by_pos[pos][tail] - 1
            if left:
                self._by_pos[pos][tail] = left
            else:
                del self._by_pos[pos][tail]
        ends: set[tuple[int, bytes]] = set()
        for i, blocks in enumerate(sessions):
            for hexd in blocks:
                idx.apply_update(IndexUpdate("stored", "mla", bytes.fromhex(hexd), "device", worker_id))
            at = checkpoints[i] if checkpoints is not None and i < len(checkpoints) else None
            for k in ([len(blocks)] if at is None else at):  # KDA checkpoints at these block counts
                if 0 < k <= len(blocks):
                    idx.apply_update(IndexUpdate("stored", "kda", bytes.fromhex(blocks[k - 1]), "device", worker_id))
            end = tails[i] if tails is not None and i < len(tails) else None
            if end:  # the unaligned turn end: tail rows and the checkpoint there, both named by the tail digest
                pos, tail = int(end[0]), bytes.fromhex(end[1])
                for kind in ("tail", "kda"):
                    idx.apply_update(IndexUpdate("stored", kind, tail, "device", worker_id))
                ends.add((pos, tail))
        for pos, tail in ends:
            per = self._by_pos.setdefault(pos, {})
            per[tail] = per.get(tail, 0) + 1
        self._ends[worker_id] = ends

    def tail_probes(self, hasher: BlockHasher, tokens: list[int], hashes: list[bytes]) -> list[TailProbe]:
        """Probes at the reported turn ends inside ``tokens`` (whose full-block digests are ``hashes``)."""
        bs = hasher.block_size
        out = []
        for pos, tails in self._by_pos.items():
            n_full = pos // bs
            if not tails or pos >= len(tokens) or n_full > len(hashes) or not pos % bs:
                continue
            tail = hasher.tail_digest(hashes[n_full - 1] if n_full else hasher.root, tokens[n_full * bs:pos])
            if tail in tails:
                out.append(TailProbe(pos, tail))
        return out


class _OwnReplicas:
    """Serve gives each replica found to the request it was found for (NOTE 1). A router sets
    ``_asked[asyncio.current_task()]`` to the pending request in ``choose_replicas``: Serve's
    routing task asks for its request's ranks, probes them, then hands over what it found."""

    _asked: WeakKeyDictionary

    def _fulfill_next_pending_request(self, replica, request_metadata=None) -> None:
        pending = self._asked.get(asyncio.current_task())
        if pending is None or pending.future.done():  # not one of this router's asks: Serve's own way
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)


class StateAwareRequestRouter(_OwnReplicas, RequestRouter):
    def initialize_state(self, policy: dict | None = None, node_events_period_s: float = 1.0,
                         prefill_pool: str | None = None, **_):
        self._hasher: BlockHasher | None = None  # built from the first replica's model id and block size
        self._prefill_pool = prefill_pool  # a decode pool's: its prefill deployment's name (NOTE 2)
        self._index = PrefixIndex()
        self._policy = StateAwareRouter(self._index, RouterConfig.from_dict(policy or {}))
        self._versions: dict[str, int] = {}
        self._snapshots = DeviceSnapshots(self._index)
        self._last_digests: tuple[list[int], bytes, list[bytes]] | None = None  # (prompt, root, digests)
        self._asked: WeakKeyDictionary = WeakKeyDictionary()  # routing task -> the request it routes (NOTE 1)
        self._node_events = NodeEventFeed(self._index, node_events_period_s)  # fed by decode routers only
        # Serve may ship this class by value: register in a module imported by reference
        router_metrics.LIVE_POLICIES[f"{getattr(self, '_deployment_id', '?')}@{id(self)}"] = self._policy
        deployment = getattr(getattr(self, "_deployment_id", None), "name", None)
        if deployment:  # as LIVE_POLICIES: in a module imported by reference
            router_metrics.POOL_VIEWS[deployment] = self.pool_view
            router_metrics.POOL_POLICIES[deployment] = self._policy
        _register_replicas(self)

    def pool_loads(self) -> list[float] | None:
        """Effective queued prefill tokens per healthy replica of this pool (None: no replica known)."""
        pool = self._pool()
        return None if pool is None else pool[1]

    def pool_view(self, query: PoolQuery) -> PoolView | None:
        """This pool for one request's P/D decision (``disagg.flow`` NOTE 5): per healthy replica,
        its effective queued prefill tokens and the prompt tokens it could not resume.

        What a replica resumes is what ``choose_replicas`` places by: the walk of this index
        (``PrefixIndex.match`` over the prompt's salted digests and tail probes; the query's
        digests when they are this pool's key space, ``_route_request``), at least the query's
        ``node_resumable`` for a replica on the query's node: that node's shared tiers, which
        its replicas read and whose events this router does not drain (module docstring); with
        the policy's ``peer_reads``, for a replica on another node too, which reads them through
        that node's state service (``disagg.flow`` NOTE 10, ``credit_node_state``).
        None: no replica known; ``uncached`` None: no replica has reported its model yet.
        """
        pool = self._pool()
        if pool is None:
            return None
        ids, loads = pool
        if self._hasher is None or not ids:
            return PoolView(loads, None)
        req = self._route_request(query.params, query.hasher, query.hashes)
        match = self._index.match(req, ids)
        if query.node_resumable > 0 and query.node_id:
            match = credit_node_state(match, set(ids), self._index.node_of, query.node_id,
                                      min(query.node_resumable, req.prompt_len), self._policy.config.peer_reads)
        return PoolView(loads, [float(req.prompt_len - r) for r in match.resumable])

    def _pool_view_before(self, params: GenerateParams, req: RouteRequest) -> PoolView | None:
        """The prefill pool as this process's router of it sees ``params`` before its decode worker
        is placed (NOTE 2); None: no such router here yet, or the policy does not read it."""
        if self._prefill_pool is None or not self._policy.config.harm_pool_view:
            return None
        try:
            return prefill_pool_view(self._prefill_pool, PoolQuery(params, self._hasher, req.block_hashes))
        except Exception:  # noqa: BLE001 - placement without the pool's figures, not a failed request
            log.warning("prefill pool view failed; placing without it", exc_info=True)
            return None

    def _pool(self) -> tuple[list[str], list[float]] | None:
        """(ids, effective queued prefill tokens) of the healthy replicas; None: no replica known."""
        replicas = list(self.curr_replicas.values())
        if not replicas:
            return None
        workers = [self._sync(r) for r in replicas]
        loads = self._policy.effective_loads(workers, self._policy.clock())
        healthy = [w.worker_id for w in workers if w.healthy]
        return healthy, [loads[wid].prefill_tokens for wid in healthy]

    def _route_request(self, params: GenerateParams, given: BlockHasher | None = None,
                       given_hashes: list[bytes] | None = None) -> RouteRequest:
        """The policy's view of ``params``: its prompt's digests under its salt, and tail probes.

        The digests are hashed once per prompt: taken from ``given_hashes`` when ``given`` is
        this pool's key space for the salt (same root and block size: the decode flow's own
        digests), else from the last request's when it carried the same prompt list (the
        placement that follows a pool view of the same request), else computed.
        """
        assert self._hasher is not None, "no replica has reported its model yet"
        hasher = self._hasher.with_salt(params.cache_salt)
        tokens = params.prompt_token_ids
        n_full = len(tokens) // hasher.block_size
        last = self._last_digests
        if (given_hashes is not None and given is not None and given.block_size == hasher.block_size
                and given.root == hasher.root and len(given_hashes) == n_full):
            hashes = given_hashes
        elif last is not None and last[0] is tokens and last[1] == hasher.root and len(last[2]) == n_full:
            hashes = last[2]
        else:
            hashes = hasher.block_hashes(tokens)
        self._last_digests = (tokens, hasher.root, hashes)
        return RouteRequest(params.request_id, params.session_id or "", hashes, len(tokens), hasher.block_size,
                            self._snapshots.tail_probes(hasher, tokens, hashes), cache_salt=params.cache_salt,
                            max_output_tokens=params.sampling.max_tokens, session_end=params.session_end)

    def _sync(self, replica) -> WorkerState:
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        if self._hasher is None and stats.get("model_id"):
            self._hasher = BlockHasher(stats["block_size"], KeyExtras(stats["model_id"]))
        node = stats.get("node_id")
        if rid not in self._versions:
            self._index.add_worker(rid, node or rid)
            self._versions[rid] = -1
        elif node and self._index.node_of(rid) != node:  # seen before its first report: join its node
            self._index.add_worker(rid, node)
        role = stats.get("role")
        if role in ("decode", "both"):  # this router owns its nodes' event logs (module docstring)
            self._node_events.watch(stats.get("node_id", ""))
        version = stats.get("device_version", -1)
        if version != self._versions[rid]:
            self._snapshots.apply(rid, stats.get("device_sessions", []), stats.get("device_tails"),
                                  stats.get("device_checkpoints"))
            self._versions[rid] = version
        load = stats.get("load", {})
        return WorkerState(rid, role if role in _POOL_ROLES else "both", node or rid,
                           queued_prefill_tokens=load.get("queued_prefill_tokens", 0),
                           queued_prefill_requests=load.get("queued_prefill_requests", 0),
                           running_decode_tokens=load.get("running_decode_tokens", 0),
                           running_decode_requests=load.get("running_decode_requests", 0),
                           inbound_decode_requests=load.get("inbound_decode_requests", 0),
                           inbound_decode_tokens=load.get("inbound_decode_tokens", 0),
                           cache_utilization=min(1.0, max(0.0, load.get("cache_utilization", 0.0))),
                           device_tokens=max(0, int(load.get("device_tokens", 0))),
                           # the report's age on this policy's clock (replicas stamp wall time)
                           updated_at=_wall_to_clock(self._policy, stats.get("time", time.time())))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """Serve's ranks for the pending request (NOTE 1): its pick, then the rest by score."""
        self._asked[asyncio.current_task()] = pending_request
        end = _session_end(pending_request)
        if end is not None:
            self._policy.end_session(session_key(end.cache_salt, end.session_id))
            return _to_named(candidate_replicas, end.replica)
        named = _named(pending_request)
        if named is not None:
            return _to_named(candidate_replicas, named)
        params = _params(pending_request)
        if params is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # no rank took it: back off, then ask again
        placed = getattr(pending_request, _PLACED, _UNPLACED)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if isinstance(placed, RouteDecision):
            if placed.decode_worker in by_id:  # asked again, booked once (NOTE 1)
                return _ranks(placed, by_id)
            self._policy.on_finished(params.request_id, None)  # its pick is gone: place it anew
            placed = _UNPLACED
        if len(candidate_replicas) <= 1:  # counted too: the decisions by reason cover every routed request
            if placed is _UNPLACED:
                self._policy.metrics.record_decision("single_candidate", None)
                setattr(pending_request, _PLACED, None)
            return [candidate_replicas]
        workers = [self._sync(r) for r in candidate_replicas]
        self._node_events.poll()
        if self._hasher is None:  # no replica has reported yet: spread by load alone
            if placed is _UNPLACED:
                self._policy.metrics.record_decision("no_stats", None)
                setattr(pending_request, _PLACED, None)
            return [sorted(candidate_replicas, key=lambda r: (r.routing_stats or {}).get("inflight", 0))]
        req = self._route_request(params)
        pool_nodes = {n for r in candidate_replicas for n in (r.routing_stats or {}).get("prefill_nodes", ())}
        decision = self._policy.route(req, workers, prefill_nodes=pool_nodes,
                                      pool_view=self._pool_view_before(params, req) if pool_nodes else None)
        self._policy.on_routed(req, decision)
        if decision.state_position > params.state_position:  # a moved session's last node (router step 4)
            params.state_node, params.state_position = decision.state_node, decision.state_position
        if decision.checkpoint_back is not None:  # where follow-ups diverge (router step 5)
            params.checkpoint_back = decision.checkpoint_back
        params.first_turn = decision.first_turn  # the decode replica's P/D decider reads it ("local_burst")
        setattr(pending_request, _PLACED, decision)
        return _ranks(decision, by_id)


def _ranks(decision: RouteDecision, by_id: dict) -> list[list]:
    """The pick, ``STATE_PROBE_ROUNDS`` times where it holds the prompt's state on its device
    (NOTE 1), then the other candidates by score."""
    pick = by_id[decision.decode_worker]
    rest = sorted((r for r in by_id.values() if r is not pick),
                  key=lambda r: -decision.scores.get(r.replica_id.unique_id, 0.0))
    holds = decision.source_tier == "device" and decision.predicted_cached_tokens > 0
    return [[pick]] * (STATE_PROBE_ROUNDS if holds else 1) + ([rest] if rest else [])


def affinity_key(params: GenerateParams, block_size: int = 64) -> str:
    if params.session_id:
        return "s:" + session_key(params.cache_salt, params.session_id)
    head = params.prompt_token_ids[:block_size]
    return "p:" + hashlib.sha256(f"{params.cache_salt}|{head}".encode()).hexdigest()


def _weight(key: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}|{replica_id}".encode()).digest()[:8], "big")


class AffinityRequestRouter(_OwnReplicas, RequestRouter):
    def initialize_state(self, **_):
        self._asked = WeakKeyDictionary()
        _register_replicas(self)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        self._asked[asyncio.current_task()] = pending_request
        end = _session_end(pending_request)
        if end is not None:
            return _to_named(candidate_replicas, end.replica)
        named = _named(pending_request)
        if named is not None:
            return _to_named(candidate_replicas, named)
        params = _params(pending_request)
        if params is None or len(candidate_replicas) <= 1:
            return [candidate_replicas]
        key = affinity_key(params)
        ranked = sorted(candidate_replicas, key=lambda r: _weight(key, r.replica_id.unique_id), reverse=True)
        rest = sorted(ranked[1:], key=lambda r: (r.routing_stats or {}).get("inflight", 0))
        return [[ranked[0]], rest]
