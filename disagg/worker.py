"""A serving worker: one engine plus the node's state store, Ray-free.

The Serve prefill and decode deployments are thin shells around this class, and
the in-process backend (tests, overhead baseline) uses it directly.

A request's path through a decode worker (the decode side orchestrates):

    resume = longest of (device-resident session, store's resumable prefix)
    suffix = prompt - resume
    suffix <= local_prefill_max_tokens or no prefill pool
        -> prefill here from ``resume``                      (conditional disagg.)
    else
        -> prefill worker: resume, compute, publish state, return a handle
        -> load the state by handle from the host tier        (checksummed)
           missing or corrupt -> recompute here, never a wrong token
    decode, streaming tokens
    turn end: publish the state at the last computed token (next turn resumes)

NOTES
1. Bulk state never travels in a Ray message: only ``PrefillHandle``.
2. ``num_cached_tokens`` counts prompt tokens whose state was reused (by the
   prefill worker when one ran); the hand-off itself is a transfer, not a hit.
3. Any failure of the state path degrades to recompute: a tier that errors, a
   checksum that fails, a load past ``load_deadline_s``.
4. A resumed request (``resumed_output_tokens > 0``: its prompt ends with its own
   earlier output, after its decode replica was lost) samples output index
   ``resumed_output_tokens`` next, so seeded sampling continues where it stopped.
5. Device hand-off (a prefill and a decode engine on two GPUs of one host):
   the prefill worker gathers the state into buffers on its GPU and returns
   their IPC descriptor in the handle; the decode worker copies them onto its
   GPU (one peer copy each, fingerprint-checked), then releases them. The
   prefill keeps the prefix resident on its device for the session's next
   turn; the decode's turn-end checkpoint still goes to the host tier.
6. A host-tier handle from a prefill replica on another node is loaded through
   ``peer_stores(handle.node_id)`` (this node's tiers, then that node's gRPC state
   service); with no peer store for that node, from this node's tiers (a miss
   there is a recompute, NOTE 3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from disagg import faults as fault_injection
from disagg.engine.protocol import EngineRequest
from disagg.faults import FaultInjector, LoadFault
from disagg.messages import GenerateParams, PrefillHandle, StreamChunk
from kv_transfer.keys import BlockHasher, KeyExtras, ObjectKey

if TYPE_CHECKING:
    from kv_transfer.store import StateStore

log = logging.getLogger(__name__)

PrefillFn = Callable[[GenerateParams], Awaitable[PrefillHandle]]
ReleaseFn = Callable[[PrefillHandle], Awaitable[None]]
PeerStoresFn = Callable[[str], "StateStore | None"]  # node_id -> a store that reads that node (NOTE 6)


@dataclass(slots=True)
class _Resume:
    state: object | None  # ResumeState to import, or None (engine may adopt a resident session)
    position: int  # tokens reused
    source: str  # device | host | disk | peer | computed
    nbytes: int = 0  # bytes loaded
    seconds: float = 0.0  # load time


class StatefulWorker:
    def __init__(self, engine, store=None, replica_id: str = "local", node_id: str = "local",
                 local_prefill_max_tokens: int = 512, prefill_retries: int = 2, load_deadline_s: float = 5.0,
                 faults: FaultInjector | None = None, retry_backoff_s: float = 0.25, device_shares=None,
                 peer_stores: PeerStoresFn | None = None):
        self.engine = engine  # AsyncEngine
        self.store = store  # kv_transfer.store.StateStore (node-shared tiers) or None
        self.replica_id = replica_id
        self.node_id = node_id
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill_retries = prefill_retries
        self.retry_backoff_s = retry_backoff_s  # pause before a retry (lets the router see a dead replica)
        self.load_deadline_s = load_deadline_s  # a state lookup + load past this recomputes (NOTE 3)
        self.faults = faults if faults is not None and faults.enabled else None
        if self.faults is not None and store is not None:
            self.faults.install(store)
        self.peer_stores = peer_stores  # node_id -> StateStore reading that node (NOTE 6); may block
        # a prefill worker with ``device_shares`` (kv_transfer.transport.device_ipc.DeviceShares) hands state
        # over device to device (NOTE 5) instead of publishing it to the host tier
        self.device_shares = device_shares
        self.hasher = BlockHasher(engine.block_size, KeyExtras(engine.model_id))
        # loaded MLA rows go straight to a GPU engine's device (kv_transfer.direct); on CPU they
        # stay in host memory, which is where the engine reads them
        device = getattr(getattr(engine, "engine", None), "device", None)
        self._load_device = device if device is not None and torch.device(device).type != "cpu" else None
        if store is not None and self._load_device is not None:
            try:  # the device checksum's kernel and constants now, not in the first resume's TTFT
                store.warm(self._load_device)
            except Exception as e:  # noqa: BLE001 - a cold first load is slower, not wrong
                log.warning("warming direct loads to %s failed: %s", self._load_device, e)
        self._tasks: set[asyncio.Task] = set()  # background publishes
        self._publishing: dict[str, set[asyncio.Task]] = {}  # session -> its publishes in flight
        self.counters = {"prefills": 0, "decodes": 0, "remote_prefills": 0, "local_prefills": 0,
                         "load_failures": 0, "load_timeouts": 0, "prefill_failures": 0, "published_bytes": 0,
                         "resumed_requests": 0, "peer_loads": 0, "peer_load_failures": 0}

    # -- state lookup ---------------------------------------------------------------
    async def _plan_resume(self, tokens: list[int], hasher: BlockHasher, params: GenerateParams) -> _Resume:
        # the engine's resident match and the store's lookup run side by side (two thread hops at once)
        resident = self.engine.call(self.engine.engine.resident_match, tokens, params.cache_salt)
        if self.store is None:
            _, device_len = await resident
            return _Resume(None, device_len, "device" if device_len else "computed")
        deadline = time.monotonic() + self.load_deadline_s  # lookup and load share one deadline
        lookup = asyncio.wait_for(asyncio.to_thread(self.store.resumable_length, tokens, hasher, len(tokens) - 1),
                                  self.load_deadline_s)
        matched, point = await asyncio.gather(resident, lookup, return_exceptions=True)
        if isinstance(matched, BaseException):
            raise matched
        _, device_len = matched
        if isinstance(point, asyncio.TimeoutError):
            self.counters["load_timeouts"] += 1
            log.warning("state lookup passed its %.1f s deadline; recomputing", self.load_deadline_s)
            point = None
        elif isinstance(point, Exception):  # a tier that fails is a miss (NOTE 3)
            self.counters["load_failures"] += 1
            log.error("state lookup failed; recomputing", exc_info=point)
            point = None
        elif isinstance(point, BaseException):  # cancelled: not a failure of the state path
            raise point
        if point is not None and point.position > device_len:
            loaded = await self._load(tokens, point.position, hasher, params, deadline)
            if loaded is not None:
                return replace(loaded, source=_source(point.slowest_tier))
        return _Resume(None, device_len, "device" if device_len else "computed")

    async def _load(self, tokens: list[int], position: int, hasher: BlockHasher, params: GenerateParams,
                    deadline: float | None = None, node_id: str | None = None) -> _Resume | None:
        """Load the state at ``position`` (held by node ``node_id`` when given, NOTE 6)."""
        t0 = time.perf_counter()
        budget = self.load_deadline_s if deadline is None else deadline - time.monotonic()
        fault = self.faults.on_load(params) if self.faults is not None else None
        remote = self.peer_stores is not None and node_id is not None and node_id != self.node_id
        try:
            state = await asyncio.wait_for(
                self._load_state(tokens, position, hasher, fault, node_id if remote else None), max(0.0, budget))
        except asyncio.TimeoutError:  # a stalled tier or peer: recompute rather than wait (NOTE 3)
            self.counters["load_timeouts"] += 1
            log.warning("state load passed its %.1f s deadline; recomputing", self.load_deadline_s)
            state = None
        except Exception:  # a tier that fails is a miss (NOTE 3)
            log.exception("state load failed; recomputing")
            state = None
        if remote:
            self.counters["peer_loads" if state is not None else "peer_load_failures"] += 1
        if state is None:
            self.counters["load_failures"] += 1
            if fault is not None:
                self.faults.recovered("load_recomputed", params, after=fault.kind)
            return None
        nbytes = sum(b.rows.nbytes for b in state.mla_blocks) + (state.tail.rows.nbytes if state.tail else 0)
        nbytes += sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
        return _Resume(state, position, "host", nbytes, time.perf_counter() - t0)

    async def _load_state(self, tokens: list[int], position: int, hasher: BlockHasher, fault: LoadFault | None,
                          node_id: str | None = None):
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)  # an injected stall that holds no thread

        def load():
            store = self._store_for(node_id)
            with fault_injection.active(fault):  # the store's tier reads see the fault (disagg.faults)
                return store.load_state(tokens, position, hasher, self.engine.layout, contiguous=True,
                                        device=self._load_device)

        # the store is thread-safe: no engine lock (steps go on while state loads)
        return await asyncio.to_thread(load)

    def _store_for(self, node_id: str | None):
        """The store that reads state held by node ``node_id`` (blocking: runs on a load thread)."""
        store = self.peer_stores(node_id) if node_id is not None and self.peer_stores is not None else None
        if store is None:
            return self.store
        if self.faults is not None:
            self.faults.install(store)  # injected transfer faults reach peer loads too
        return store

    async def _publish(self, request_id: str, tokens: list[int], hasher: BlockHasher,
                       also_at: tuple[int, ...] = ()) -> tuple[int, float]:
        """Publish a held request's state at its current position (and at the earlier checkpoints
        ``also_at``, e.g. the prompt end), then release it to the device tier."""
        t0 = time.perf_counter()
        nbytes = 0
        try:
            if self.store is not None:
                for pos in (len(tokens), *also_at):  # the longest first: later ones share its blocks
                    present = await asyncio.to_thread(self._present_blocks, tokens[:pos], hasher)
                    state = await self.engine.export_state(request_id, pos, present)
                    result = await asyncio.to_thread(self.store.put_state, tokens[:pos], state, hasher)
                    nbytes += result.bytes_stored
                self.counters["published_bytes"] += nbytes
        except Exception:
            log.exception("publishing state failed; the next turn will recompute")
        finally:
            await self.engine.release(request_id)
        return nbytes, time.perf_counter() - t0

    def _present_blocks(self, tokens: list[int], hasher: BlockHasher) -> int:
        digests = hasher.block_hashes(tokens)
        if not digests:
            return 0
        flags = self.store.contains_keys([ObjectKey("mla", d) for d in digests])
        n = 0
        while n < len(flags) and flags[n]:
            n += 1
        return n

    # -- prefill (runs on a prefill worker) ---------------------------------------------------
    async def prefill(self, params: GenerateParams) -> PrefillHandle:
        kill = self.faults is not None and self.faults.should_kill_prefill(params)
        t0 = time.perf_counter()
        tokens = params.prompt_token_ids
        hasher = self.hasher.with_salt(params.cache_salt)
        plan = await self._plan_resume(tokens, hasher, params)
        rid = f"{params.request_id}/prefill"
        req = EngineRequest(rid, tokens, replace(params.sampling, max_tokens=1), resume=plan.state,
                            keep_state=True, first_output_index=params.resumed_output_tokens,
                            cached_source=plan.source, cache_salt=params.cache_salt)
        last = None
        async for out in self.engine.generate(req):
            last = out
        assert last is not None and last.new_token_ids, "prefill produced no token"
        compute_s = time.perf_counter() - t0
        if kill:
            await self._injected_prefill_kill(rid, params)
        shared = None
        try:
            if self.device_shares is not None:  # NOTE 5
                t1 = time.perf_counter()
                try:
                    state = await self.engine.export_state(rid, None, 0, on_device=True)
                    shared = await asyncio.to_thread(self.device_shares.share, state)
                finally:
                    await self.engine.release(rid)  # the prefix stays resident on this device for the next turn
                nbytes, pub_s = shared.nbytes, time.perf_counter() - t1
            else:  # the prompt end, and its aligned checkpoint (engine NOTE 5) for a next prompt that only shares blocks
                try:
                    positions = await self.engine.call(
                        getattr(self.engine.engine, "checkpoint_positions", lambda _: []), rid)
                except KeyError:  # not held any more: publish the prompt end alone (``_publish`` logs, releases)
                    positions = []
                earlier = tuple(sorted((p for p in positions if p < len(tokens)), reverse=True))
                nbytes, pub_s = await self._publish(rid, tokens, hasher, earlier)
        except BaseException:  # cancelled (the client left) or failed before the release: the held
            self._spawn(_quietly(self.engine.release(rid), f"release of {rid}"), None)  # blocks go back
            if shared is not None:
                self._spawn(_quietly(asyncio.to_thread(self.device_shares.release, shared.share_id),
                                     f"device hand-off {shared.share_id}"), None)
            raise
        self.counters["prefills"] += 1
        return PrefillHandle(len(tokens), last.new_token_ids[0], last.num_cached_tokens, last.cached_source,
                             self.replica_id, self.node_id, nbytes, pub_s, compute_s, shared,
                             last.logprobs[0] if last.logprobs else None)

    # -- generate (runs on a decode worker) -----------------------------------------------------
    async def generate(self, params: GenerateParams, prefill_fn: PrefillFn | None = None,
                       release_fn: ReleaseFn | None = None) -> AsyncIterator[StreamChunk]:
        """``release_fn(handle)`` tells a prefill replica that its device hand-off was copied (NOTE 5)."""
        pending = self._publishing.get(_session_key(params))
        if pending:  # this session's previous turn end is being published: let it land first
            await asyncio.wait(list(pending), timeout=1.0)
        tokens = list(params.prompt_token_ids)
        hasher = self.hasher.with_salt(params.cache_salt)
        sampling = params.sampling
        kill_after = self.faults.kill_decode_after(params) if self.faults is not None else None
        self.counters["resumed_requests"] += int(params.resumed_output_tokens > 0)
        plan = await self._plan_resume(tokens, hasher, params)
        handle = None
        if prefill_fn is not None and len(tokens) - plan.position > self.local_prefill_max_tokens:
            handle = await self._remote_prefill(params, prefill_fn)
        first_index = params.resumed_output_tokens  # NOTE 4
        cached, source = plan.position, plan.source
        transfer_bytes, transfer_s = plan.nbytes, plan.seconds
        if handle is not None:
            self.counters["remote_prefills"] += 1
            cached, source = handle.num_cached_tokens, handle.cached_source
            first = StreamChunk([handle.first_token], num_prompt_tokens=len(tokens), num_cached_tokens=cached,
                                cached_source=source, replica_id=self.replica_id,
                                logprobs=[handle.first_logprob] if handle.first_logprob is not None else None)
            stop = _is_stop(handle.first_token, sampling, self.engine.engine)
            going_on = False
            try:
                if stop or sampling.max_tokens == 1:  # a stop token outranks the length (as in the engine)
                    first.finished, first.finish_reason = True, "stop" if stop else "length"
                    yield first
                    return
                yield first
                if kill_after == 1:
                    await self._injected_kill(params, 1)
                going_on = True
            finally:  # done, or closed after the first token: a device hand-off is released unopened
                if not going_on and handle.device_state is not None and release_fn is not None:
                    self._spawn(_quietly(release_fn(handle), f"device hand-off {handle.device_state.share_id}"),
                                None)
            if handle.device_state is not None:
                loaded = await self._open_device_state(handle, release_fn)
            else:
                loaded = await self._load(tokens, handle.position, hasher, params, node_id=handle.node_id)
            plan = loaded or _Resume(None, 0, "computed")
            transfer_bytes, transfer_s = plan.nbytes, plan.seconds
            tokens = tokens + [handle.first_token]
            sampling = replace(sampling, max_tokens=sampling.max_tokens - 1)
            first_index += 1
        else:
            self.counters["local_prefills"] += 1
        rid = f"{params.request_id}/decode"
        req = EngineRequest(rid, tokens, sampling, resume=plan.state, keep_state=True,
                            first_output_index=first_index, cached_source=plan.source, cache_salt=params.cache_salt)
        finished = False
        num_streamed = first_index - params.resumed_output_tokens
        try:
            async with aclosing(self.engine.generate(req)) as outs:  # closing this stream aborts the request
                async for out in outs:
                    chunk = StreamChunk(out.new_token_ids, out.finished, out.finish_reason,
                                        len(params.prompt_token_ids), cached if handle else out.num_cached_tokens,
                                        source if handle else out.cached_source, out.error, transfer_bytes,
                                        transfer_s, self.replica_id, out.logprobs)
                    if out.finished:
                        finished = True
                        if out.finish_reason in ("length", "stop"):  # checkpoint the turn end off the response path
                            self._spawn(self._publish_turn_end(rid, hasher), _session_key(params))
                    yield chunk
                    num_streamed += len(out.new_token_ids)
                    if kill_after is not None and not finished and num_streamed >= kill_after:
                        await self._injected_kill(params, num_streamed)
        finally:  # an unfinished request was aborted when ``outs`` closed (async_engine NOTE 4)
            self.counters["decodes"] += 1

    async def _open_device_state(self, handle: PrefillHandle, release_fn: ReleaseFn | None) -> _Resume | None:
        """Copy a prefill replica's device hand-off onto this engine's device (NOTE 5)."""
        from kv_transfer.transport.device_ipc import open_shared

        t0 = time.perf_counter()
        desc = handle.device_state
        try:
            state = await asyncio.to_thread(open_shared, desc, self.engine.engine.device)
        except Exception:  # a bad or vanished hand-off is a miss: recompute (NOTE 3)
            self.counters["load_failures"] += 1
            log.exception("device hand-off %s failed; recomputing", desc.share_id)
            state = None
        finally:
            if release_fn is not None:
                await _quietly(release_fn(handle), f"release of device hand-off {desc.share_id}")
        if state is None:
            return None
        return _Resume(state, handle.position, "peer", desc.nbytes, time.perf_counter() - t0)

    async def _injected_prefill_kill(self, rid: str, params: GenerateParams) -> None:
        """Die mid-request: the prompt is computed, its state not yet published.

        The pause lets the replica's acceptance of the call reach the caller first, so the
        caller sees a replica that died while running its request (and retries it in
        ``_remote_prefill``), not one that was already dead when the request was sent (which
        Ray Serve itself re-routes before the worker ever sees a failure).
        """
        await asyncio.sleep(0.2)
        try:
            self.faults.kill("kill_prefill", params)
        finally:  # ``InjectedCrash`` (no process to exit): the kept state is not leaked
            await self.engine.release(rid)

    async def _injected_kill(self, params: GenerateParams, num_streamed: int) -> None:
        await asyncio.sleep(0.2)  # let the streamed tokens leave the replica: the death is mid-stream
        self.faults.kill("kill_decode", params, after_tokens=num_streamed)

    async def _publish_turn_end(self, rid: str, hasher: BlockHasher) -> None:
        eng = self.engine.engine
        try:
            computed, positions = await self.engine.call(
                lambda: (eng.computed_tokens(rid), eng.checkpoint_positions(rid)))
        except KeyError:  # the engine no longer holds the request (it failed or was aborted)
            log.warning("turn end of %s not published: the engine no longer holds it", rid)
            return
        earlier = tuple(sorted((p for p in positions if p < len(computed)), reverse=True))
        await self._publish(rid, computed, hasher, earlier)

    def _spawn(self, coro, session: str | None) -> None:
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

    async def _remote_prefill(self, params: GenerateParams, prefill_fn: PrefillFn) -> PrefillHandle | None:
        for attempt in range(self.prefill_retries + 1):
            try:
                handle = await prefill_fn(params)
                if attempt and self.faults is not None:
                    self.faults.recovered("prefill_retried", params, attempts=attempt + 1,
                                          prefill_replica=handle.replica_id)
                return handle
            except Exception as exc:  # a dead or failing prefill replica: retry, then prefill here
                self.counters["prefill_failures"] += 1
                log.warning("remote prefill attempt %d failed (%s)", attempt + 1, exc)
                if attempt < self.prefill_retries:
                    await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
        if self.faults is not None:
            self.faults.recovered("prefill_local", params, attempts=self.prefill_retries + 1)
        return None

    def stats(self) -> dict:
        out = {"worker": dict(self.counters), "engine": self.engine.engine.stats()}
        if self.store is not None:
            out["store"] = self.store.stats()
        return out


def continue_params(params: GenerateParams, streamed: list[int], attempt: int) -> GenerateParams:
    """The request that continues ``params`` after its output ``streamed`` was sent (NOTE 4).

    The prompt grows by the streamed tokens and ``max_tokens`` shrinks by as many, so greedy (and
    seeded) decoding of the continuation yields exactly the tokens the lost stream had left to send.
    """
    assert len(streamed) < params.sampling.max_tokens, "nothing left to continue"
    return replace(params, request_id=f"{params.request_id}~{attempt}",
                   prompt_token_ids=[*params.prompt_token_ids, *streamed],
                   sampling=replace(params.sampling, max_tokens=params.sampling.max_tokens - len(streamed)),
                   resumed_output_tokens=params.resumed_output_tokens + len(streamed), prefill=None)


def _session_key(params: GenerateParams) -> str | None:
    return f"{params.cache_salt}|{params.session_id}" if params.session_id else None


def _source(tier: str | None) -> str:
    """Metric source name of a tier: host, disk, or peer for any remote tier."""
    if tier is None:
        return "computed"
    return "peer" if tier.startswith("remote") else tier


async def _quietly(work, what: str) -> None:
    """Await ``work``, logging instead of raising (clean-ups spawned off a closing request)."""
    try:
        await work
    except Exception:  # noqa: BLE001 - the owner expires what is left (device_ipc NOTE 1)
        log.warning("%s failed", what, exc_info=True)


def _is_stop(token: int, sampling, engine) -> bool:
    return token in sampling.stop_token_ids or (not sampling.ignore_eos and token == engine.eos_token_id)
