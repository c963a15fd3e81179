"""What ``disagg serve`` prints while serving (``disagg.console``): exact lines and the log's order."""

from __future__ import annotations

from disagg.console import RequestLog, RequestRecord, format_request, format_stats


def rec(rid: str, prompt: int = 100, cached: int = 0, out: int = 10, ttft: float | None = 0.05,
        status: str = "length") -> RequestRecord:
    return RequestRecord(rid, prompt, cached, "host" if cached else "computed", out, ttft, 0.5, status)


def test_since_returns_each_record_once_in_order():
    log = RequestLog(capacity=8)
    for i in range(3):
        log.add(rec(f"r{i}"))
    got, last = log.since(0)
    assert [r.request_id for r in got] == ["r0", "r1", "r2"] and [r.seq for r in got] == [1, 2, 3]
    assert last == 3
    log.add(rec("r3"))
    got, last = log.since(last)
    assert [r.request_id for r in got] == ["r3"] and last == 4
    assert log.since(4) == ([], 4)


def test_a_poller_behind_by_more_than_the_capacity_skips_the_oldest():
    log = RequestLog(capacity=2)
    for i in range(5):
        log.add(rec(f"r{i}"))
    got, last = log.since(0)
    assert [r.request_id for r in got] == ["r3", "r4"] and last == 5


def test_request_line():
    assert format_request(rec("cmpl-1", prompt=1536, cached=1472, out=32, ttft=0.0412)) == (
        "request cmpl-1 prompt=1536 cached=1472 (host) out=32 ttft=41.2ms e2e=0.50s length")
    assert format_request(rec("cmpl-2", out=0, ttft=None, status="http_503")).endswith(
        "out=0 ttft=- e2e=0.50s http_503")


def test_stats_line_sums_roles_and_reports_the_window():
    stats = {"engines": {"decode": {"running": 2, "waiting": 1}, "prefill": {"running": 1, "waiting": 0}},
             "tiers": {"host": {"used_bytes": 128 << 20, "capacity_bytes": 1024 << 20},
                       "disk": {"used_bytes": 0, "capacity_bytes": 0}}}
    records = [rec("a", prompt=1000, cached=900, out=50), rec("b", prompt=1000, cached=0, out=50)]
    assert format_stats(records, 10.0, stats) == (
        "stats: running 3, queued 1 | 10.0 gen tok/s, 200 prompt tok/s | hit 45.0% (2 req) | host 12.5% of 1,024 MiB")


def test_stats_line_without_stats_or_traffic():
    assert format_stats([], 10.0, {}) == (
        "stats: running ?, queued ? | 0.0 gen tok/s, 0 prompt tok/s | hit - (0 req) | tiers ?")
