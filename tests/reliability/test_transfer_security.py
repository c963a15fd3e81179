"""The gRPC state service refuses strangers and listens only where it is told to; a stalled or
dead peer holding a request's state costs a recompute within the worker's deadline, never a hang.

Deeper transport cases (TLS, mTLS, frame limits, reconnects) live in tests/kv_transfer/transport.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import grpc
import pytest
import torch

from disagg.config import GrpcConfig, load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.framing import Chunk, KeyBatch
from kv_transfer.transport.grpc_protocol import TOKEN_METADATA_KEY, method_path
from kv_transfer.transport.grpc_transport import (
    RemoteStore,
    RemoteStoreConfig,
    StateServer,
    StateServerConfig,
)

TOKEN = "reliability-token-1f2e"


@pytest.fixture
def served():
    """A DictByteStore served on 127.0.0.1 with TOKEN; yields (store, server)."""
    store = DictByteStore()
    store.put_bytes("mla:secret", b"tenant state")
    server = StateServer(store, StateServerConfig(token=TOKEN, address="127.0.0.1:0"))
    server.start()
    yield store, server
    server.stop(0)


@pytest.mark.parametrize("metadata", [None, ((TOKEN_METADATA_KEY, "wrong"),), ((TOKEN_METADATA_KEY, TOKEN + "x"),),
                                      (("authorization", f"Bearer {TOKEN}"),)])
def test_calls_without_the_token_are_unauthenticated_and_touch_nothing(served, metadata):
    store, server = served
    with grpc.insecure_channel(server.address) as channel:
        fetch = channel.unary_stream(method_path("Fetch"))
        with pytest.raises(grpc.RpcError) as err:
            list(fetch(KeyBatch(["mla:secret"]).encode(), timeout=5, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        push = channel.stream_unary(method_path("Push"))
        with pytest.raises(grpc.RpcError) as err:
            push(iter([Chunk("mla:planted", 3, 0, b"bad").encode()]), timeout=5, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert store.keys() == ["mla:secret"]
    assert server.stats().num_auth_failures == 2


def test_the_right_token_is_served(served):
    _, server = served
    with RemoteStore(RemoteStoreConfig(server.address, token=TOKEN)) as client:
        assert client.get_bytes("mla:secret") == b"tenant state"
    with RemoteStore(RemoteStoreConfig(server.address, token="wrong-token", timeout_s=2)) as client:
        assert client.get_bytes("mla:secret") is None and client.stats()["auth_failures"] == 1


def test_the_server_listens_only_on_its_configured_interface():
    """A server told 127.0.0.2 is not reachable on 127.0.0.1 at the same port. The port is taken
    on 127.0.0.1 first, bound and not listening, so nothing else in the process or on the machine
    can answer there while the test runs (a port picked for 127.0.0.2 alone was once another
    listener's on 127.0.0.1); a server that bound every interface could not start beside it."""
    assert GrpcConfig().bind.startswith("127.0.0.1:"), "the default is loopback, never all interfaces"
    guard = socket.socket()
    guard.bind(("127.0.0.1", 0))
    port = guard.getsockname()[1]
    server = StateServer(DictByteStore(), StateServerConfig(token=TOKEN, address=f"127.0.0.2:{port}"))
    try:
        assert server.start() == port
        with socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with RemoteStore(RemoteStoreConfig(f"127.0.0.2:{port}", token=TOKEN)) as client:
            assert client.put_bytes("mla:k", b"v") and client.get_bytes("mla:k") == b"v"
    finally:
        server.stop(0)
        guard.close()


def test_message_size_limit_refuses_oversize_frames():
    store = DictByteStore()
    server = StateServer(store, StateServerConfig(token=TOKEN, chunk_bytes=1 << 19, max_message_bytes=1 << 20))
    server.start()
    try:
        big = RemoteStoreConfig(server.address, token=TOKEN, chunk_bytes=4 << 20, max_message_bytes=8 << 20,
                                timeout_s=5)
        with RemoteStore(big) as client:
            assert client.put_bytes("mla:big", b"x" * (3 << 20)) is False
            assert client.stats()["rejected"] == 1
        assert len(store) == 0
    finally:
        server.stop(0)


# -- a peer holding the state stalls or dies ----------------------------------------------------
class _Gate(HostTier):
    """The peer's host tier; its reads block while ``running`` is clear (the peer hangs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.running = threading.Event()
        self.running.set()

    def get_bytes(self, key):
        self.running.wait(30)
        return super().get_bytes(key)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


def test_stalled_or_dead_peer_costs_a_recompute_within_the_deadline():
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    peer_tier = _Gate(128 << 20, pin_memory=False)
    server = StateServer(peer_tier, StateServerConfig(token=TOKEN))
    server.start()
    remote = RemoteStore(RemoteStoreConfig(server.address, token=TOKEN, timeout_s=60))
    workers = []
    try:
        # the peer's worker computes a first turn and publishes its state into the peer's host tier
        peer = StatefulWorker(AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options)),
                              StateStore([peer_tier], engine.layout), "peer")
        here_store = StateStore([HostTier(128 << 20, pin_memory=False), remote], engine.layout, promote=False)
        here = StatefulWorker(AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options)),
                              here_store, "here",
                              options=FlowOptions(DeciderConfig(local_prefill_max_tokens=10_000), load_deadline_s=1.0))
        workers = [peer, here]
        first = _ids(300, 31)
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)

        async def generate(worker, prompt, rid):
            t0 = time.monotonic()
            out = []
            async for chunk in worker.generate(GenerateParams(rid, prompt, sampling, session_id="s")):
                out.extend(chunk.token_ids)
            elapsed = time.monotonic() - t0
            await worker.drain()
            return out, elapsed

        def run(worker, prompt, rid):
            loop = asyncio.new_event_loop()  # closing it does not wait for a load thread still stuck on the peer
            try:
                return loop.run_until_complete(generate(worker, prompt, rid))
            finally:
                loop.close()

        reply, _ = run(peer, first, "t1")
        follow = first + reply + _ids(30, 32)
        ref = ReferenceEngine(engine.model, engine.model_id, engine.options)
        want, _ = ref.generate(EngineRequest("ref", follow, sampling))
        assert here_store.resumable_length(follow, here.hasher, len(follow) - 1).position >= 256, "the peer has it"

        peer_tier.running.clear()  # the peer hangs: its reads never answer within the 60 s RPC deadline
        got, elapsed = run(here, follow, "t2")
        assert got == want
        assert elapsed < 30, "the 1 s load deadline, not the peer's 60 s, decided"
        assert here.counters["load_timeouts"] == 1
        peer_tier.running.set()

        server.stop(0)  # the peer is gone: presence checks fail fast and the prompt is computed
        got, elapsed = run(here, follow, "t3")
        assert got == want and elapsed < 30
        assert remote.stats()["unavailable"] >= 1
    finally:
        peer_tier.running.set()
        server.stop(0)
        remote.close()
        for w in workers:
            w.engine.shutdown()
        torch.set_num_threads(threads)
