"""Store events for a router's prefix index.

Tiers and the state store emit a ``StoreEvent`` whenever an object is stored,
evicted or moved between tiers; a router drains the ``EventLog`` with
``take()`` and updates its index of where each prefix lives.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["stored", "evicted", "moved"]


@dataclass(slots=True, frozen=True)
class StoreEvent:
    kind: EventKind  # what happened to the object
    key: str  # str(ObjectKey) of the object
    object_kind: str  # "mla" | "tail" | "kda" ("" when the key is not an ObjectKey)
    tier: str  # tier the event happened in ("moved": the destination tier)
    worker_id: str = ""  # worker (or node) owning the tier
    position: int | None = None  # resume position for kda / tail objects
    parent: bytes | None = None  # tails: digest of the last full block before the tail
    nbytes: int = 0  # encoded size
    timestamp: float = field(default_factory=time.time)  # wall clock, seconds

    def __repr__(self) -> str:
        return f"StoreEvent({self.kind} {self.key} in {self.tier}, {self.nbytes} B)"


def object_kind_of(key: str) -> str:
    kind = key.split(":", 1)[0]
    return kind if kind in ("mla", "tail", "kda") else ""


class EventLog:
    """Bounded, thread-safe event buffer.

    NOTES
    1. Holds at most ``max_events``; when full the oldest events are dropped and
       counted in ``num_dropped`` (the router then resyncs).
    2. ``take()`` returns events in emission order and empties the log.
    """

    def __init__(self, max_events: int = 65536):
        if max_events <= 0:
            raise ValueError("max_events must be positive")
        self._events: deque[StoreEvent] = deque()
        self._max = max_events
        self._lock = threading.Lock()
        self.num_dropped = 0
        self.num_emitted = 0

    def emit(self, event: StoreEvent) -> None:
        with self._lock:
            if len(self._events) >= self._max:
                self._events.popleft()
                self.num_dropped += 1
            self._events.append(event)
            self.num_emitted += 1

    def take(self, max_events: int | None = None) -> list[StoreEvent]:
        with self._lock:
            n = len(self._events) if max_events is None else min(max_events, len(self._events))
            return [self._events.popleft() for _ in range(n)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
