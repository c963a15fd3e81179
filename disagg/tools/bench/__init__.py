"""Agentic-trace benchmark: trace format, synthesis, replay client, metrics, plots.

Modules, imports pointing down:

    trace, mooncake, synth, stats, tokens    trace data (pure Python + numpy)
    client, testserver                       HTTP edge (aiohttp)
    runner                                   closed/open-loop replay
    metrics, servermetrics, cost, pareto     numbers from results
    report, plots, sweep, cli                files, figures, commands

See docs/bench.md for usage and metric definitions.
"""

from __future__ import annotations

from disagg.tools.bench.trace import TraceError, TraceRecord, load_trace, save_trace

__all__ = ["TraceError", "TraceRecord", "load_trace", "save_trace"]
