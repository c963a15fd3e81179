"""Server-side cache hit rate from Prometheus ``/metrics`` scrapes.

The harness scrapes ``/metrics`` before and after a run and differences the
prompt-token counters. By default it reads::

    disagg_prompt_tokens_total{source="device"|"host"|"disk"|"peer"|"computed"}

(summed over any other labels, e.g. per worker). Hit rate = tokens served
from a cache tier / all prompt tokens = (device + host + disk + peer) /
(device + host + disk + peer + computed). When that counter is absent it
falls back to vLLM's ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``; when both are absent the result says so
(``available=False``) instead of failing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_COUNTER = "disagg_prompt_tokens_total"
HIT_SOURCES: tuple[str, ...] = ("device", "host", "disk", "peer")
MISS_SOURCES: tuple[str, ...] = ("computed",)
VLLM_HITS = "vllm:prefix_cache_hits_total"
VLLM_QUERIES = "vllm:prefix_cache_queries_total"

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_prometheus(text: str) -> Samples:
    """Samples of a Prometheus text exposition: ``{(name, sorted labels): value}``."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        samples[(m.group(1), labels)] = value
    return samples


def counter_by_label(samples: Samples, name: str, label: str = "source") -> dict[str, float]:
    """Sum a counter's samples by one label's value (``""`` when the label is absent)."""
    out: dict[str, float] = {}
    for (sample_name, labels), value in samples.items():
        if sample_name != name:
            continue
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


REUSE_MISSES = "disagg_reuse_miss_tokens_total"
REUSE_BOUND = "disagg_reuse_bound_tokens_total"


def reuse_delta(before: str | None, after: str | None) -> dict:
    """Missed prompt tokens by reason and the server's infinite-cache bound over a run
    (``disagg.reuse.misses``); empty when the server does not expose them."""
    if before is None or after is None:
        return {}
    b, a = parse_prometheus(before), parse_prometheus(after)
    miss_a = counter_by_label(a, REUSE_MISSES, "reason")
    bound_a = counter_total(a, REUSE_BOUND)
    if not miss_a or bound_a is None:
        return {}
    miss_b = counter_by_label(b, REUSE_MISSES, "reason")
    misses = {k: v - miss_b.get(k, 0.0) for k, v in miss_a.items()}
    return {"misses": {k: v for k, v in misses.items() if v}, "bound_tokens": bound_a - (counter_total(b, REUSE_BOUND) or 0.0)}


def counter_total(samples: Samples, name: str) -> float | None:
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


@dataclass(slots=True)
class ServerCacheStats:
    """Difference of the server's prompt-token counters over a run."""

    available: bool = False  # counters found in both scrapes
    counter: str = ""  # which counter family was used
    tokens_by_source: dict[str, float] = field(default_factory=dict)  # source -> tokens in the run
    hit_rate: float | None = None  # cached prompt tokens / all prompt tokens
    note: str = ""  # why it is unavailable

    def to_dict(self) -> dict:
        return {
            "available": self.available,
            "counter": self.counter,
            "tokens_by_source": self.tokens_by_source,
            "hit_rate": self.hit_rate,
            "note": self.note,
        }


def cache_delta(
    before: str | None,
    after: str | None,
    *,
    counter: str = DEFAULT_COUNTER,
    hit_sources: tuple[str, ...] = HIT_SOURCES,
    miss_sources: tuple[str, ...] = MISS_SOURCES,
) -> ServerCacheStats:
    """Server-side hit rate between two ``/metrics`` scrapes (None: scrape failed)."""
    if before is None or after is None:
        return ServerCacheStats(note="metrics endpoint not reachable")
    b, a = parse_prometheus(before), parse_prometheus(after)
    src_b, src_a = counter_by_label(b, counter), counter_by_label(a, counter)
    if src_a:
        delta = {k: v - src_b.get(k, 0.0) for k, v in src_a.items()}
        hits = sum(delta.get(s, 0.0) for s in hit_sources)
        total = hits + sum(delta.get(s, 0.0) for s in miss_sources)
        return ServerCacheStats(True, counter, delta, hits / total if total > 0 else None)
    hits_a, queries_a = counter_total(a, VLLM_HITS), counter_total(a, VLLM_QUERIES)
    if hits_a is not None and queries_a is not None:
        hits = hits_a - (counter_total(b, VLLM_HITS) or 0.0)
        queries = queries_a - (counter_total(b, VLLM_QUERIES) or 0.0)
        return ServerCacheStats(
            True,
            "vllm:prefix_cache",
            {"hits": hits, "queries": queries},
            hits / queries if queries > 0 else None,
        )
    return ServerCacheStats(note=f"counter {counter!r} not exposed")
