"""Shared test helpers: real servers on loopback."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from disagg.launch.local import free_port


@contextlib.contextmanager
def serve_asgi(app, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app with uvicorn on 127.0.0.1 in a thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def tiny_aggregated_backend() -> Iterator:
    """``tiny_backend("aggregated")``."""
    with tiny_backend("aggregated") as backend:
        yield backend


@contextlib.contextmanager
def tiny_backend(mode: str, http: dict | None = None) -> Iterator:
    """An ``InProcessBackend`` over the tiny reference model (one torch thread, small cache and
    host tier) in ``mode``; disaggregated, prompts past 64 uncached tokens go to its prefill
    worker. ``http``: the ``http`` config section. torch's thread count is restored afterwards."""
    import torch

    from disagg.config import load_config
    from disagg.launch.inprocess import InProcessBackend

    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
                       "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}},
                       "deployment": {"mode": mode}, "http": http or {},
                       **({"router": {"local_prefill_max_tokens": 64}} if mode == "disaggregated" else {})})
    backend = InProcessBackend(cfg)
    try:
        yield backend
    finally:
        backend.shutdown()
        torch.set_num_threads(threads)
