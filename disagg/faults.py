"""Fault injection: drop, delay or corrupt state transfers and kill replicas, on purpose.

Off unless ``faults.enabled``. The reliability tests and the soak run turn it on to show that
every fault ends in a recompute or a continued stream, never in a wrong or lost token.

Config example (the ``faults:`` section of the app config)::

    faults:
      enabled: true
      ledger_path: /tmp/disagg-faults.jsonl      # one JSON line per injected fault
      rules:
        - {fault: corrupt, rate: 0.05}                        # 5% of state loads read a flipped byte
        - {fault: kill_decode, nth: 1, session_prefix: kd-}   # first kd-* request of each decode replica

Faults, the event each is decided on, and the recovery that must follow:

    fault         event                     effect                                  recovery
    drop          a state load              every tier read fails (unavailable)     recompute
    delay         a state load              the load stalls ``delay_s``             deadline, then recompute
    corrupt       a state load              one object reads back with a flipped    checksum catches it: the object
                                            byte                                    is dropped, recompute
    kill_prefill  a prefill call            the prefill replica exits once the      retry on another, else prefill locally
                                            prompt is computed (before publishing)
    kill_decode   a decode request (never   the decode replica exits after          the ingress continues the stream on
                  a resumed one)            ``after_tokens`` streamed tokens        another replica from those tokens

Transfer faults act inside the tiers (``install`` wraps a store's tiers), so the real code paths
handle them: the store's checksum check, the worker's deadline and its recompute fallback.

Where they plug in: the decode-side flow (``disagg.flow``) runs over interfaces, and the faults
wrap those, not the flow: ``FaultyState`` wraps its ``FlowState`` (a fault decided per state
load), ``guard_decode`` wraps a decode stream (kill after N streamed tokens) and
``guard_prefill_fn`` wraps the remote-prefill call (records retries), and on the prefill side
``guard_prefill_engine`` wraps the engine of one prefill call (the kill falls between its
compute and its publish).

NOTES
1. Each event is decided once, on the replica serving it: ``rate`` draws come from a generator
   seeded with (seed, replica id); ``nth`` counts the eligible events this replica process has
   seen (a restarted replica counts anew).
2. An injected kill interrupts a request at most once, so every request makes progress: a
   resumed decode request (``resumed_output_tokens > 0``) is never killed, nor is a request the
   ledger already shows killed (a prefill retried on another replica, a continued stream).
3. A fault is appended to the ledger before it acts (a killed replica still leaves its line);
   the recovery that follows is appended too (``{"recovery": ...}`` lines), so a run can tell
   injected faults from survived ones across replicas that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from disagg.config import FaultConfig, FaultRule
from disagg.messages import GenerateParams

log = logging.getLogger(__name__)

TRANSFER_FAULTS = ("drop", "delay", "corrupt")


class InjectedCrash(RuntimeError):
    """The default "kill" where no process may exit (in-process workers): the request fails."""


@dataclass(slots=True)
class LoadFault:
    """A transfer fault decided for one state load."""

    kind: str  # drop | delay | corrupt
    delay_s: float = 0.0  # "delay": seconds the load stalls
    num_corrupted: int = 0  # "corrupt": objects corrupted so far (one per load)


_ACTIVE: ContextVar[LoadFault | None] = ContextVar("disagg_load_fault", default=None)


@contextlib.contextmanager
def active(fault: LoadFault | None) -> Iterator[None]:
    """Apply ``fault`` to the tier reads made inside the block (this thread / context only)."""
    token = _ACTIVE.set(fault)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def exit_process() -> None:
    """Kill the current process at once, as a crash would (no cleanup, no drain)."""
    os._exit(17)


class FaultInjector:
    """Decides and records the faults of one replica.

    Args:
        config: the ``faults`` section.
        replica_id: seeds the rate draws and names the replica in the ledger.
        role: "prefill" | "decode" | "local" (ledger only).
        kill: how this replica dies (Ray replicas: ``exit_process``); default raises ``InjectedCrash``.
    """

    def __init__(self, config: FaultConfig, replica_id: str, role: str = "local",
                 kill: Callable[[], None] | None = None):
        self.config = config
        self.replica_id = replica_id
        self.role = role
        self._kill = kill
        self._rng = random.Random(f"{config.seed}:{replica_id}")
        self._seen: dict[int, int] = {}  # rule index -> eligible events seen
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {}  # fault kind -> injected here

    @property
    def enabled(self) -> bool:
        return self.config.enabled and bool(self.config.rules)

    # -- decisions ----------------------------------------------------------------
    def _pick(self, kinds: tuple[str, ...], params: GenerateParams | None) -> FaultRule | None:
        if not self.enabled:
            return None
        session = (params.session_id if params is not None else None) or ""
        for i, rule in enumerate(self.config.rules):
            if rule.fault not in kinds:
                continue
            if rule.session_prefix is not None and not session.startswith(rule.session_prefix):
                continue
            with self._lock:
                n = self._seen[i] = self._seen.get(i, 0) + 1
                hit = (rule.nth and n == rule.nth) or (rule.rate > 0 and self._rng.random() < rule.rate)
            if hit:
                return rule
        return None

    def on_load(self, params: GenerateParams | None) -> LoadFault | None:
        """The transfer fault for one state load, or None."""
        rule = self._pick(TRANSFER_FAULTS, params)
        if rule is None:
            return None
        self.record(rule.fault, params, delay_s=rule.delay_s if rule.fault == "delay" else None)
        return LoadFault(rule.fault, rule.delay_s if rule.fault == "delay" else 0.0)

    def kill_decode_after(self, params: GenerateParams) -> int | None:
        """Tokens after which this decode request kills its replica, or None (NOTE 2)."""
        if params.resumed_output_tokens or self._killed_before(params):
            return None
        rule = self._pick(("kill_decode",), params)
        return None if rule is None else rule.after_tokens

    def should_kill_prefill(self, params: GenerateParams) -> bool:
        if self._killed_before(params):
            return False
        return self._pick(("kill_prefill",), params) is not None

    def _killed_before(self, params: GenerateParams) -> bool:
        if not self.enabled or not self.config.ledger_path:
            return False
        root = params.request_id.split("~")[0]  # a continuation is "<id>~<n>" (disagg.workers.tiered.continue_params)
        return any(e.get("fault", "").startswith("kill") and (e.get("request_id") or "").split("~")[0] == root
                   for e in read_ledger(self.config.ledger_path))

    # -- actions ------------------------------------------------------------------
    def kill(self, kind: str, params: GenerateParams | None, **extra) -> None:
        """Record the kill, then die (or raise ``InjectedCrash``)."""
        self.record(kind, params, **extra)
        log.warning("fault injection: %s on replica %s", kind, self.replica_id)
        if self._kill is None:
            raise InjectedCrash(f"injected {kind} on {self.replica_id}")
        self._kill()

    def record(self, kind: str, params: GenerateParams | None, **extra) -> None:
        """Count an injected fault and append it to the ledger."""
        with self._lock:
            self.counters[kind] = self.counters.get(kind, 0) + 1
        self._append({"fault": kind}, params, extra)

    def recovered(self, how: str, params: GenerateParams | None, **extra) -> None:
        """Append a recovery (e.g. "load_recomputed", "prefill_retried") to the ledger (NOTE 3)."""
        with self._lock:
            self.counters[f"recovered:{how}"] = self.counters.get(f"recovered:{how}", 0) + 1
        self._append({"recovery": how}, params, extra)

    def _append(self, what: dict, params: GenerateParams | None, extra: dict) -> None:
        path = self.config.ledger_path
        if not path:
            return
        line = {"time": time.time(), **what, "role": self.role, "replica": self.replica_id,
                "request_id": params.request_id if params is not None else None,
                "session_id": params.session_id if params is not None else None,
                **{k: v for k, v in extra.items() if v is not None}}
        with open(path, "a") as f:  # one write per line: appends from many processes stay whole
            f.write(json.dumps(line) + "\n")

    # -- wrappers of the request flow's interfaces (disagg.flow) ----------------------------
    async def guard_decode(self, params: GenerateParams, chunks: AsyncIterator) -> AsyncIterator:
        """``chunks`` (a decode stream), killing the replica after ``after_tokens`` streamed tokens
        when a kill_decode rule picks this request (decided before the stream starts)."""
        kill_after = self.kill_decode_after(params)
        async with contextlib.aclosing(chunks):  # a kill closes the stream: its engine request aborts
            num_streamed = 0
            async for chunk in chunks:
                yield chunk
                num_streamed += len(chunk.token_ids)
                if kill_after is not None and not chunk.finished and num_streamed >= kill_after:
                    await asyncio.sleep(0.2)  # let the streamed tokens leave the replica: a mid-stream death
                    self.kill("kill_decode", params, after_tokens=num_streamed)

    def guard_prefill_fn(self, prefill_fn: Callable, attempts: int) -> Callable:
        """``prefill_fn`` recording its recoveries: a success after failures ("prefill_retried"),
        or ``attempts`` failures in a row ("prefill_local": the decode replica prefills)."""
        tries = 0

        async def call(params: GenerateParams):
            nonlocal tries
            tries += 1
            try:
                handle = await prefill_fn(params)
            except Exception:
                if tries == attempts:
                    self.recovered("prefill_local", params, attempts=attempts)
                raise
            if tries > 1:
                self.recovered("prefill_retried", params, attempts=tries, prefill_replica=handle.replica_id)
            return handle

        return call

    def guard_prefill_engine(self, engine, params: GenerateParams):
        """``engine`` for one prefill call: when a kill_prefill rule picks ``params`` (decided now,
        before compute), the replica dies once the prompt is computed, before its state is
        published or shared (the engine's stream ends, then the kill)."""
        return _PrefillKill(engine, self, params) if self.should_kill_prefill(params) else engine

    def install(self, store) -> None:
        """Wrap the tiers of a ``StateStore`` so loads run under an ``active`` fault see it."""
        if not any(isinstance(t, FaultyTier) for t in store.tiers):
            store.tiers = [FaultyTier(t) for t in store.tiers]


class _PrefillKill:
    """An engine whose next ``generate`` kills the replica after its last output (``guard_prefill_engine``)."""

    def __init__(self, engine, faults: FaultInjector, params: GenerateParams):
        self._engine, self._faults, self._params = engine, faults, params

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, req, state=None) -> AsyncIterator:
        async for out in self._engine.generate(req, state):
            yield out
        # The pause lets the replica's acceptance of the call reach the caller first, so the caller
        # sees a replica that died while running its request (and retries it in
        # ``RequestFlow.remote_prefill``), not one already dead when the request was sent (which
        # Ray Serve itself re-routes before the worker ever sees a failure).
        await asyncio.sleep(0.2)
        try:
            self._faults.kill("kill_prefill", self._params)
        finally:  # ``InjectedCrash`` (no process to exit): the kept state is not leaked
            await self._engine.release(req.request_id)


def read_ledger(path: str) -> list[dict]:
    """The faults recorded in a ledger file (missing file: none)."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


class _Copy:
    """A lease-shaped holder of corrupted bytes (what ``StateStore`` reads from ``get_view``)."""

    def __init__(self, data: bytearray):
        self.view = memoryview(data)

    def __enter__(self) -> _Copy:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        self.view.release()


def _flip(data: bytearray) -> bytearray:
    data[len(data) // 2] ^= 0x5A  # one byte in the payload: the CRC-32 trailer catches it
    return data


class FaultyTier:
    """A ``ByteStore`` tier that obeys the load fault active in the calling context.

    Everything but reads is passed through; with no active fault reads are too.
    """

    def __init__(self, tier):
        self._tier = tier
        if hasattr(tier, "get_view"):  # StateStore picks zero-copy reads by this attribute
            self.get_view = self._get_view

    def __getattr__(self, name: str):
        return getattr(self._tier, name)

    def _get_view(self, key: str):
        fault = _ACTIVE.get()
        if fault is None:
            return self._tier.get_view(key)
        if fault.kind == "drop":
            raise ConnectionError(f"injected: tier {self._tier.name} unavailable")
        if fault.kind == "corrupt" and not fault.num_corrupted:
            lease = self._tier.get_view(key)
            if lease is None:
                return None
            with lease:
                data = bytearray(lease.view)
            fault.num_corrupted += 1
            return _Copy(_flip(data))
        return self._tier.get_view(key)

    def get_bytes(self, key: str):
        fault = _ACTIVE.get()
        if fault is None:
            return self._tier.get_bytes(key)
        if fault.kind == "drop":
            raise ConnectionError(f"injected: tier {self._tier.name} unavailable")
        data = self._tier.get_bytes(key)
        if fault.kind == "corrupt" and not fault.num_corrupted and data is not None:
            fault.num_corrupted += 1
            return bytes(_flip(bytearray(data)))
        return data


class FaultyState:
    """A ``disagg.flow.FlowState`` whose state loads see the transfer faults (drop, delay, corrupt).

    Each load (by position, or by a host-tier handle) asks ``FaultInjector.on_load``; a delay
    stalls without holding a thread, drop and corrupt act in the wrapped store's tiers
    (``install``, also on every peer store). A faulted load that yields nothing is recorded as
    recovered by recompute ("load_recomputed"). A device hand-off is never faulted.
    """

    def __init__(self, inner, faults: FaultInjector):
        self.inner = inner
        self.faults = faults
        inner.wrap_stores(faults.install)

    async def lookup(self, tokens, hasher, limit=None):
        return await self.inner.lookup(tokens, hasher, limit)

    async def load(self, tokens, position, hasher, params, node_id=None, first_block=0):
        return await self._faulted(params, lambda: self.inner.load(tokens, position, hasher, params, node_id,
                                                                   first_block))

    async def open(self, handle, tokens, hasher, params, release_fn, first_block=0):
        if handle.device_state is not None:
            return await self.inner.open(handle, tokens, hasher, params, release_fn, first_block)
        return await self._faulted(params, lambda: self.inner.open(handle, tokens, hasher, params, release_fn,
                                                                   first_block))

    async def publish(self, engine, request_id, tokens, hasher, also_at=()):
        return await self.inner.publish(engine, request_id, tokens, hasher, also_at)

    async def demote(self, points):
        return await self.inner.demote(points)

    async def demote_blocks(self, node_id, hashes):
        return await self.inner.demote_blocks(node_id, hashes)

    async def recall(self, tokens, hasher, from_position, timeout_s, held_blocks=0):
        return await self.inner.recall(tokens, hasher, from_position, timeout_s, held_blocks)

    async def _faulted(self, params, work: Callable):
        fault = self.faults.on_load(params)
        if fault is None:
            return await work()
        got = None
        try:  # a deadline or a failure ends here too: every faulted load that came to nothing recomputes
            if fault.kind == "delay":
                await asyncio.sleep(fault.delay_s)  # an injected stall that holds no thread
            with active(fault):  # the tier reads (in the load's thread, which copies this context) see it
                got = await work()
            return got
        finally:
            if got is None:
                self.faults.recovered("load_recomputed", params, after=fault.kind)
