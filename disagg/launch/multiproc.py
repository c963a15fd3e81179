"""Engines in worker processes, one per device, behind one HTTP front; no Ray.

For hosts without Ray (the GPU machines the benchmarks run on) and for
process-level hand-offs between GPUs of one host. Each worker process owns
one engine on one device (``cuda:i`` or ``cpu``) and serves a small RPC on a
Unix socket; ``ProcessBackend`` implements the HTTP API's backend protocol
over them, so ``disagg.api.app.create_app`` serves it as it serves Ray Serve.

    layout          the front sends to          state between prefill and decode
    "1p1d"          the decode process          the decode calls the prefill process;
                                                handoff "device": CUDA IPC + peer copy
                                                handoff "host": the shared host tier
    "aggregated"    one of N by session         -

A node-wide host tier (``HostTierServer`` in the front process, one
``HostTierClient`` per worker) holds turn-end checkpoints in both layouts
unless ``host_tier=False``.

NOTES
1. RPC: one Unix-socket connection per call; frames are a 4-byte length and a
   pickle. A streaming call answers with ("item", x) frames and one ("end",)
   or ("error", message). Bulk state never travels here: a device hand-off's
   descriptor is a few hundred bytes.
2. Aggregated placement is sticky per session (hash of the session id), so a
   session's turns find its state resident; requests without a session go to
   the worker with the fewest requests in flight.
3. Worker processes are started with the ``spawn`` method (CUDA cannot be
   forked) and exit when the front closes their control pipe.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing as mp
import os
import pickle
import struct
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

from disagg.api.metrics import merge_replica_stats
from disagg.config import AppConfig
from disagg.messages import GenerateParams, SessionEnd, StreamChunk

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")


async def _send(writer: asyncio.StreamWriter, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader):
    try:
        head = await reader.readexactly(_LEN.size)
        return pickle.loads(await reader.readexactly(_LEN.unpack(head)[0]))
    except asyncio.IncompleteReadError:
        return None


class RpcClient:
    """Calls into one worker process (NOTE 1)."""

    def __init__(self, path: str):
        self.path = path

    async def call(self, method: str, *args):
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            await _send(writer, (method, args))
            reply = await _recv(reader)
        finally:
            writer.close()
        if reply is None:
            raise ConnectionError(f"worker at {self.path} closed the connection during {method}")
        if reply[0] == "error":
            raise RuntimeError(reply[1])
        return reply[1]

    async def stream(self, method: str, *args) -> AsyncIterator:
        reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            await _send(writer, (method, args))
            while True:
                reply = await _recv(reader)
                if reply is None:
                    raise ConnectionError(f"worker at {self.path} closed the stream of {method}")
                if reply[0] == "end":
                    return
                if reply[0] == "error":
                    raise RuntimeError(reply[1])
                yield reply[1]
        finally:
            writer.close()  # a cancelled consumer closes the socket: the worker aborts the request


@dataclass(slots=True)
class WorkerSpec:
    """What one worker process runs."""

    name: str  # e.g. "prefill-0", "decode-0", "agg-1"
    role: str  # "prefill" | "decode" | "aggregated"
    device: str  # torch device of its engine
    socket: str  # its RPC socket path
    prefill_socket: str | None = None  # a decode worker's prefill process
    handoff: str = "host"  # "device" | "host": how a prefill worker hands state over
    pool_mb: int = 0  # a device hand-off's staging pool (device_ipc NOTE 4; 0: share buffer by buffer)


def _worker_main(cfg_json: str, spec: WorkerSpec, host_socket: str | None, ready, control) -> None:
    """Entry point of a worker process."""
    logging.basicConfig(level=os.environ.get("DISAGG_LOG_LEVEL", "WARNING"))
    cfg = AppConfig.model_validate_json(cfg_json)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": spec.device})})
    try:
        asyncio.run(_serve_worker(cfg, spec, host_socket, ready, control))
    except Exception as exc:  # tell the front why it never came up
        ready.send(f"error: {exc!r}")
        raise


async def _serve_worker(cfg: AppConfig, spec: WorkerSpec, host_socket: str | None, ready, control) -> None:
    import torch

    from disagg.engine.async_engine import AsyncEngine
    from disagg.engine.factory import build_reference_engine
    from disagg.flow import FlowOptions
    from disagg.workers.tiered import StatefulWorker

    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    engine = build_reference_engine(cfg)
    store = None
    if host_socket is not None:
        from kv_transfer.store import StateStore
        from kv_transfer.tiers.host_ipc import HostTierClient

        store = StateStore([HostTierClient(host_socket)], engine.layout, write_behind=False, worker_id=spec.name)
    shares = None
    if spec.role == "prefill" and spec.handoff == "device":
        from kv_transfer.transport.device_ipc import DeviceShares

        shares = DeviceShares(pool_bytes=spec.pool_mb << 20)
    worker = StatefulWorker(AsyncEngine(engine), store, spec.name, "local", options=FlowOptions.from_config(cfg),
                            device_shares=shares, device_holds=cfg.transfer.host.victim and spec.role != "prefill")
    prefill = RpcClient(spec.prefill_socket) if spec.prefill_socket else None
    prefill_fn = (lambda p: prefill.call("prefill", p)) if prefill is not None else None
    release_fn = (lambda h: prefill.call("release", h.device_state.share_id)) if prefill is not None else None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        msg = await _recv(reader)
        if msg is None:
            writer.close()
            return
        method, args = msg
        try:
            if method == "generate":
                gen = worker.generate(args[0], prefill_fn, release_fn)
                watch = asyncio.ensure_future(reader.read(1))  # EOF: the front went away (cancel)
                try:
                    async for chunk in gen:
                        if watch.done():
                            break
                        await _send(writer, ("item", chunk))
                    else:
                        await _send(writer, ("end",))
                finally:
                    watch.cancel()
                    await gen.aclose()
            elif method == "prefill":
                await _send(writer, ("ok", await worker.prefill(args[0])))
            elif method == "release":
                await _send(writer, ("ok", shares.release(args[0]) if shares is not None else False))
            elif method == "stats":
                out = dict(worker.stats(), role=spec.role)
                if shares is not None:
                    out["device_shares"] = shares.stats()
                await _send(writer, ("ok", out))
            elif method == "drain":
                await worker.drain()
                await _send(writer, ("ok", True))
            elif method == "end_session":
                await _send(writer, ("ok", await worker.end_session(args[0])))
            else:
                await _send(writer, ("error", f"unknown method {method!r}"))
        except (ConnectionError, BrokenPipeError):
            pass
        except Exception as exc:  # report, keep serving
            log.exception("%s failed in %s", method, spec.name)
            try:
                await _send(writer, ("error", f"{type(exc).__name__}: {exc}"))
            except (ConnectionError, BrokenPipeError):
                pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, spec.socket)
    os.chmod(spec.socket, 0o600)  # in a 0700 directory already; owner-only whatever the umask
    ready.send("ok")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, _wait_closed, control)  # the front closed the pipe: exit
    server.close()
    worker.shutdown()


def _wait_closed(conn) -> None:
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        return


class ProcessBackend:
    """``GenerationBackend`` over worker processes (see the module docstring)."""

    def __init__(self, cfg: AppConfig, devices: list[str], layout: str = "1p1d", handoff: str = "device",
                 host_tier: bool = True, start_timeout_s: float = 600.0, pool_mb: int | None = None):
        from disagg.engine.factory import build_tokenizer, engine_limits

        if layout not in ("1p1d", "aggregated"):
            raise ValueError(f"layout must be '1p1d' or 'aggregated', got {layout!r}")
        if handoff not in ("device", "host"):
            raise ValueError(f"handoff must be 'device' or 'host', got {handoff!r}")
        if layout == "1p1d" and len(devices) != 2:
            raise ValueError("layout '1p1d' takes two devices: prefill's, then decode's")
        if layout == "1p1d" and handoff == "host" and not host_tier:
            raise ValueError("handoff 'host' needs the host tier")
        self.config = cfg
        self.layout = layout
        self._dir = tempfile.mkdtemp(prefix="disagg-mp-")
        self.host = self.host_server = None
        if host_tier:
            from kv_transfer.tiers.host import HostTier
            from kv_transfer.tiers.host_ipc import HostTierServer

            self.host = HostTier(cfg.transfer.host.capacity_mb << 20, eviction=cfg.transfer.host.policy,
                                 slab_bytes=(cfg.transfer.host.slab_kb << 10) or None)
            self.host_server = HostTierServer(self.host, os.path.join(self._dir, "host.sock"))
        sock = lambda name: os.path.join(self._dir, f"{name}.sock")  # noqa: E731
        if pool_mb is None:  # the device hand-off's staging pool: room for a few 128K-token states on a GPU
            pool_mb = 2048 if devices[0].startswith("cuda") else 64
        if layout == "1p1d":
            specs = [WorkerSpec("prefill-0", "prefill", devices[0], sock("prefill-0"), handoff=handoff, pool_mb=pool_mb),
                     WorkerSpec("decode-0", "decode", devices[1], sock("decode-0"), prefill_socket=sock("prefill-0"))]
        else:
            specs = [WorkerSpec(f"agg-{i}", "aggregated", d, sock(f"agg-{i}")) for i, d in enumerate(devices)]
        self.specs = specs
        ctx = mp.get_context("spawn")
        self._procs, self._controls = [], []
        cfg_json = cfg.model_dump_json()
        host_socket = self.host_server.socket_path if self.host_server is not None else None
        readies = []
        for spec in specs:
            ready_r, ready_w = ctx.Pipe(duplex=False)
            ctl_r, ctl_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(cfg_json, spec, host_socket, ready_w, ctl_r),
                            name=spec.name, daemon=True)
            p.start()
            ready_w.close()
            ctl_r.close()
            self._procs.append(p)
            self._controls.append(ctl_w)
            readies.append(ready_r)
        for spec, r in zip(specs, readies, strict=True):
            if not r.poll(start_timeout_s):
                self.shutdown()
                raise TimeoutError(f"worker {spec.name} did not start within {start_timeout_s:.0f} s")
            status = r.recv()
            if status != "ok":
                self.shutdown()
                raise RuntimeError(f"worker {spec.name} failed to start: {status}")
        self.clients = {s.name: RpcClient(s.socket) for s in specs}
        self._front = [s.name for s in specs if s.role != "prefill"]  # who the front sends requests to
        self._inflight = dict.fromkeys(self._front, 0)
        self.tokenizer = build_tokenizer(cfg)
        limits = engine_limits(cfg)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size
        self.model_name = cfg.model.openai_name

    def _pick(self, params: GenerateParams) -> str:
        if len(self._front) == 1:
            return self._front[0]
        if params.session_id:  # NOTE 2
            h = int.from_bytes(hashlib.blake2b(params.session_id.encode(), digest_size=8).digest(), "big")
            return self._front[h % len(self._front)]
        return min(self._front, key=self._inflight.__getitem__)

    async def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        name = self._pick(params)
        self._inflight[name] += 1
        try:
            async for chunk in self.clients[name].stream("generate", params):
                yield chunk
        finally:
            self._inflight[name] -= 1

    async def stats(self) -> dict:
        return merge_replica_stats(list((await self.raw_stats()).values()))

    async def raw_stats(self) -> dict[str, dict]:
        """Each worker's own stats, by name (benchmarks read the device hand-off counters here)."""
        parts = await asyncio.gather(*(c.call("stats") for c in self.clients.values()))
        return dict(zip(self.clients, parts, strict=True))

    async def drain(self) -> None:
        await asyncio.gather(*(c.call("drain") for c in self.clients.values()))

    async def end_session(self, session_id: str, cache_salt: str = "") -> int:
        """Tell every decode-side worker the session is over (``disagg.flow`` NOTE 14): the objects
        their nodes' tiers now evict first."""
        end = SessionEnd(session_id, cache_salt)
        return sum(await asyncio.gather(*(self.clients[n].call("end_session", end) for n in self._front)))

    def shutdown(self) -> None:
        for c in self._controls:
            c.close()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._controls, self._procs = [], []
        if self.host_server is not None:
            self.host_server.close()
            self.host_server = None
        if self.host is not None:
            self.host.close()
            self.host = None

