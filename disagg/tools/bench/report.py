"""Saving and loading benchmark results.

Layout of an output directory::

    out/
      summary.json             bench config, one entry per run, Pareto front + targets
      runs/<label>/summary.json
      runs/<label>/requests.jsonl       one line per request (times in ms)
      runs/<label>/requests.parquet     with parquet=True
      pareto.png, latency_cdf.png       see plots.py

A request line holds ``send_s`` (seconds since the run started), ``ttft_ms``,
``itl_ms``, ``e2e_ms``, token counts, status and error class, its trace
context (session, turn, lane, salt, warm-up flag) and, with ``chunks=True``,
``chunk_ms``: every token chunk's arrival in ms after send.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg.tools.bench.client import RequestResult
from disagg.tools.bench.metrics import RunSummary
from disagg.tools.bench.pareto import DEFAULT_TARGETS, front_at, pareto_front
from disagg.tools.bench.runner import RunOutput

SCHEMA_VERSION = 1


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def result_row(r: RequestResult, t0_ns: int, chunks: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": r.request_id,
        "session_id": r.session_id,
        "turn": r.turn,
        "lane": r.lane,
        "salt": r.salt,
        "warmup": r.warmup,
        "send_s": round((r.send_ns - t0_ns) / 1e9, 6),
        "ttft_ms": _r(r.ttft_ms),
        "itl_ms": _r(r.itl_ms, 4),
        "e2e_ms": _r(r.e2e_ms),
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "input_length": r.input_length,
        "expected_output": r.expected_output,
        "status": r.status,
        "error": r.error,
        "error_detail": r.error_detail or None,
    }
    if chunks:
        row["chunk_ms"] = [round((t - r.send_ns) / 1e6, 3) for t in r.chunk_ns]
    return row


def run_label(output: RunOutput) -> str:
    cfg = output.config
    return cfg.label or (
        f"c{cfg.concurrency}" if cfg.mode == "closed" else f"open-x{cfg.speedup:g}"
    )


def save_run(
    out_dir: str | Path,
    output: RunOutput,
    summary: RunSummary,
    *,
    parquet: bool = False,
    chunks: bool = False,
) -> Path:
    """Write one run's requests (JSONL, optional Parquet) and summary; returns its directory."""
    run_dir = Path(out_dir) / "runs" / run_label(output)
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [result_row(r, output.started_ns, chunks) for r in output.results]
    with open(run_dir / "requests.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), run_dir / "requests.parquet")
    doc = {"label": run_label(output), "config": output.config_dict(), "summary": summary.to_dict()}
    (run_dir / "summary.json").write_text(json.dumps(_clean(doc), indent=2))
    return run_dir


def sweep_document(
    bench_config: dict[str, Any],
    runs: Sequence[tuple[RunOutput, RunSummary]],
    targets: Sequence[float] = DEFAULT_TARGETS,
) -> dict[str, Any]:
    """The top-level summary: every run plus the Pareto front and its values at targets."""
    entries = []
    for output, summary in runs:
        entries.append(
            {
                "label": run_label(output),
                "concurrency": output.config.concurrency,
                "mode": output.config.mode,
                "summary": summary.to_dict(),
            }
        )
    points = [
        (e["summary"]["p90_interactivity"], e["summary"]["total_tps_per_gpu"])
        for e in entries
        if e["summary"]["valid"]
    ]
    labels = [e["label"] for e in entries if e["summary"]["valid"]]
    front = pareto_front(points)
    at = front_at(points, targets)
    return _clean(
        {
            "schema_version": SCHEMA_VERSION,
            "config": bench_config,
            "runs": entries,
            "pareto": {
                "x": "p90_interactivity (tok/s/user)",
                "y": "total_tps_per_gpu",
                "front": [labels[i] for i in front],
                "at_targets": [{"interactivity": t, "total_tps_per_gpu": at[t]} for t in targets],
            },
        }
    )


def save_sweep(
    out_dir: str | Path,
    bench_config: dict[str, Any],
    runs: Sequence[tuple[RunOutput, RunSummary]],
    targets: Sequence[float] = DEFAULT_TARGETS,
) -> Path:
    path = Path(out_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sweep_document(bench_config, runs, targets), indent=2))
    return path


def load_sweep(path: str | Path) -> dict[str, Any]:
    """Read a sweep summary (a directory or its summary.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "summary.json"
    if not p.exists():
        raise FileNotFoundError(f"no summary.json at {path}")
    doc = json.loads(p.read_text())
    doc["_dir"] = str(p.parent)
    return doc


def sweep_points(doc: dict[str, Any]) -> tuple[list[tuple[float, float]], list[str]]:
    """(P90 interactivity, total tok/s/GPU) of each valid run, and the run labels."""
    points, labels = [], []
    for e in doc["runs"]:
        s = e["summary"]
        x, y = s.get("p90_interactivity"), s.get("total_tps_per_gpu")
        if s.get("valid") and x is not None and y is not None:
            points.append((float(x), float(y)))
            labels.append(e["label"])
    return points, labels


def load_requests(run_dir: str | Path) -> list[dict[str, Any]]:
    with open(Path(run_dir) / "requests.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def latency_lists(doc: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    """Per run label: (TTFT ms, ITL ms) of measured successful requests."""
    out = {}
    for e in doc["runs"]:
        run_dir = Path(doc["_dir"]) / "runs" / e["label"]
        if not (run_dir / "requests.jsonl").exists():
            continue
        rows = [r for r in load_requests(run_dir) if not r["warmup"] and r["error"] is None]
        out[e["label"]] = (
            [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None],
            [r["itl_ms"] for r in rows if r["itl_ms"] is not None],
        )
    return out
