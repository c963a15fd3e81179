"""What a running server prints: one line per request and a periodic stats line.

The ingress keeps its finished requests in a :class:`RequestLog` (a bounded
ring with sequence numbers); ``disagg serve`` polls it and prints, like
``vllm serve`` does::

    request cmpl-3f2a9c01 prompt=1536 cached=1472 (host) out=32 ttft=41.2ms e2e=0.88s length
    stats: running 2, queued 0 | 31.5 gen tok/s, 2,210 prompt tok/s | hit 95.8% (10 req) | host 12.5% of 512 MiB

NOTES
1. Sequence numbers start at 1 and grow by one per record; ``since(n)`` returns the
   records after ``n`` that the ring still holds and the newest number, so a poller
   that fell behind by more than the ring's capacity skips the oldest (it never
   repeats one). Each ingress replica numbers its own records: a poller keeps one
   number per replica.
2. A record's repr and line carry no prompt text or token ids, only counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class RequestRecord:
    """One finished request, as the ingress saw it (ingress -> ``disagg serve`` driver)."""

    request_id: str  # the OpenAI response id
    num_prompt_tokens: int  # prompt length
    num_cached_tokens: int  # prompt tokens whose state was reused
    cached_source: str  # where the reused state came from: device | host | disk | peer | computed
    num_output_tokens: int  # tokens generated
    ttft_s: float | None  # arrival at the backend to the first token (None: no token)
    e2e_s: float  # arrival at the backend to the end
    status: str  # finish reason (length, stop, abort), or error / cancelled / an exception name
    seq: int = 0  # position in the RequestLog (NOTE 1)


class RequestLog:
    """The ingress's recent finished requests (module NOTES 1-2)."""

    def __init__(self, capacity: int = 4096) -> None:
        assert capacity > 0, "capacity must be positive"
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self.last_seq = 0

    def add(self, record: RequestRecord) -> None:
        self.last_seq += 1
        record.seq = self.last_seq
        self._records.append(record)

    def since(self, seq: int) -> tuple[list[RequestRecord], int]:
        """Records newer than ``seq`` (oldest first) and the newest sequence number."""
        return [r for r in self._records if r.seq > seq], self.last_seq


def format_request(r: RequestRecord) -> str:
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s * 1e3:.1f}ms"
    return (f"request {r.request_id} prompt={r.num_prompt_tokens} cached={r.num_cached_tokens} "
            f"({r.cached_source}) out={r.num_output_tokens} ttft={ttft} e2e={r.e2e_s:.2f}s {r.status}")


def format_stats(records: Iterable[RequestRecord], window_s: float, stats: dict) -> str:
    """The periodic line: load now, throughput and prefix-cache hit rate over the window, tier use.

    ``stats`` is the shape ``disagg.api.metrics.merge_replica_stats`` returns (``engines``,
    ``tiers``); missing parts print as "?".
    """
    records = list(records)
    window_s = max(window_s, 1e-9)
    engines = stats.get("engines")
    if engines:
        running = sum(e.get("running", 0) for e in engines.values())
        queued = sum(e.get("waiting", 0) for e in engines.values())
        load = f"running {running}, queued {queued}"
    else:
        load = "running ?, queued ?"
    prompt = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.num_cached_tokens for r in records)
    gen = sum(r.num_output_tokens for r in records)
    hit = f"{cached / prompt:.1%}" if prompt else "-"
    rates = f"{gen / window_s:,.1f} gen tok/s, {prompt / window_s:,.0f} prompt tok/s"
    return f"stats: {load} | {rates} | hit {hit} ({len(records)} req) | {format_tiers(stats.get('tiers') or {})}"


def format_tiers(tiers: dict) -> str:
    """``host 12.5% of 512 MiB, device:decode 3.1% of 256 MiB`` (tiers with a capacity)."""
    parts = []
    for name, t in sorted(tiers.items()):
        cap = t.get("capacity_bytes", 0)
        if cap:
            parts.append(f"{name} {t.get('used_bytes', 0) / cap:.1%} of {cap / (1 << 20):,.0f} MiB")
    return ", ".join(parts) or "tiers ?"
