"""Write-behind of a tier's evictions to another node's store (spill to the pool).

A node that runs no prefill replica keeps its sessions' state in its own host
tier; what that tier (or, when enabled, its disk tier) evicts would be lost and
recomputed. ``Spiller`` sends those evictions to a store on another node instead
(a ``RemoteStore`` of a prefill node's gRPC state service, see
``deployments.node_store``). The prefill replicas of that node then resume the
session from their own host tier, and the receiving tier reports the objects to
the routers as any put.

    host tier --on_evict--> Spiller.offer --queue--> writer thread --put_many--> target()

NOTES
1. ``offer`` never blocks and never raises: it queues a copy, or refuses when
   ``max_pending_bytes`` are already queued or the spiller is closed (counted
   ``num_dropped``). A dropped object is a later recompute, never a wrong output:
   the keys are content addresses and the bytes carry their checksums.
2. The writer sends in batches of up to ``batch_bytes`` to ``target()``, asked
   again for every batch (the set of pool nodes changes). None: no target now,
   the batch is dropped (``num_no_target``).
3. An object the target refuses (no room, a failed call) is counted in
   ``num_refused`` and not retried: a spill is best effort, and an object
   evicted under pressure is the least likely to be resumed.
4. Each key is queued at most once: an offer of a key queued or being sent is a no-op (True).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from kv_transfer.tiers.base import ByteStore

log = logging.getLogger(__name__)


class Spiller:
    def __init__(self, target: Callable[[], ByteStore | None], *, max_pending_bytes: int = 256 << 20,
                 batch_bytes: int = 16 << 20, name: str = "spill"):
        if max_pending_bytes <= 0 or batch_bytes <= 0:
            raise ValueError("max_pending_bytes and batch_bytes must be positive")
        self.name = name
        self.max_pending_bytes, self.batch_bytes = max_pending_bytes, batch_bytes
        self._target = target
        self._cv = threading.Condition()
        self._queue: OrderedDict[str, bytes] = OrderedDict()
        self._pending_bytes = 0
        self._sending: frozenset[str] = frozenset()  # the batch the writer took from the queue
        self._closed = False
        self._counters = dict.fromkeys(("num_offered", "num_spilled", "num_refused", "num_dropped",
                                        "num_no_target", "bytes_spilled"), 0)
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True)
        self._writer.start()

    def offer(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Queue ``data`` to be written to the target (NOTE 1); False when refused."""
        n = memoryview(data).nbytes
        with self._cv:
            self._counters["num_offered"] += 1
            if key in self._queue or key in self._sending:
                return True
            if self._closed or self._pending_bytes + n > self.max_pending_bytes:
                self._counters["num_dropped"] += 1
                return False
            self._queue[key] = bytes(data)
            self._pending_bytes += n
            self._cv.notify()
        return True

    def _take(self) -> dict[str, bytes] | None:
        with self._cv:
            while not self._queue and not self._closed:
                self._cv.wait()
            if not self._queue:
                return None  # closed and drained
            batch, size = {}, 0
            while self._queue and (not batch or size + len(next(iter(self._queue.values()))) <= self.batch_bytes):
                key, data = self._queue.popitem(last=False)
                batch[key] = data
                size += len(data)
            self._pending_bytes -= size
            self._sending = frozenset(batch)
            return batch

    def _write_loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._send(batch)
            finally:
                with self._cv:
                    self._sending = frozenset()
                    self._cv.notify_all()

    def _send(self, batch: dict[str, bytes]) -> None:
        try:
            target = self._target()
        except Exception:  # noqa: BLE001 - finding a target is best effort (NOTE 2)
            log.warning("%s: no target found", self.name, exc_info=True)
            target = None
        if target is None:
            with self._cv:
                self._counters["num_no_target"] += len(batch)
            return
        try:
            put_many = getattr(target, "put_many", None)
            stored = put_many(batch) if put_many else {k: target.put_bytes(k, v) for k, v in batch.items()}
        except Exception:  # noqa: BLE001 - a failed call refuses the batch (NOTE 3)
            log.warning("%s: writing %d objects to %s failed", self.name, len(batch), target.name, exc_info=True)
            stored = {}
        ok = [k for k in batch if stored.get(k)]
        with self._cv:
            self._counters["num_spilled"] += len(ok)
            self._counters["num_refused"] += len(batch) - len(ok)
            self._counters["bytes_spilled"] += sum(len(batch[k]) for k in ok)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything offered so far has been sent (or refused); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._sending, timeout_s)

    def stats(self) -> dict[str, int]:
        with self._cv:
            return {**self._counters, "pending_bytes": self._pending_bytes}

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then stop the writer; later offers are dropped."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout_s)
