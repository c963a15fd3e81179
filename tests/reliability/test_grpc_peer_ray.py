"""Cross-node state transfer wired into the Serve application (``transfer.grpc.enabled``), on a
local Ray cluster of two nodes (two raylets on this machine, each its own node id, node store,
host tier and gRPC state service):

    node "far":  PrefillServer -> host tier far  --gRPC (token)-->  DecodeServer on node "head"
    node "head": Ingress, DecodeServer, host tier head

A prompt longer than ``local_prefill_max_tokens`` is prefilled on the far node; the decode replica
loads the published state from the far node's service. Its greedy output equals the reference
engine's (the run with no transfer at all), and the far node's service counts the objects it
sent. A client with a wrong token is refused by the same service.

Spill to the pool (``transfer.spill``, turned on here): the head runs no prefill replica, so what
its host tier evicts goes to the far node's host tier, and a session pushed out of the decode
node is resumed by the far prefill from there, to the same tokens.
"""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest
import torch

from disagg.config import load_config
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.launch.local import APP_NAME, free_port, wait_healthy

pytestmark = pytest.mark.ray
MODEL = "disagg-tiny"
TOKEN_ENV = "DISAGG_TRANSFER_TOKEN"
TOKEN = "peer-cluster-token-6e0d"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from disagg.launch.local import export_cluster_env, local_app

    if ray.is_initialized():
        pytest.skip("needs its own Ray cluster")
    saved = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN  # every node's processes inherit it, as from `ray start`
    export_cluster_env()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"head_node": 8}})
    far = cluster.add_node(num_cpus=2, resources={"far_node": 8})
    threads = torch.get_num_threads()
    try:
        ray.init(address=cluster.address, namespace="disagg", log_to_driver=False)
        cfg = load_config("deployments/configs/local-cpu.yaml")
        cfg.http.port = free_port()
        cfg.router.local_prefill_max_tokens = 64
        cfg.transfer.host.capacity_mb = 512  # 8 slabs of 64 MiB: room for each size class spilled to the far node
        cfg.transfer.host.policy = "lru"  # the spill test pushes the oldest state out with newer objects
        cfg.engine.cache_budget_mb = 8  # 16 KDA slots and ~20 blocks: a few sessions displace the first
        cfg.transfer.grpc = cfg.transfer.grpc.model_validate({"enabled": True, "bind": ":0", "token_env": TOKEN_ENV})
        cfg.transfer.spill.enabled = True  # the head runs no prefill replica: it spills to the far node
        cfg.deployment.prefill.resources = {"far_node": 1}
        cfg.deployment.decode.resources = {"head_node": 1}
        cfg.deployment.ingress.resources = {"head_node": 1}
        for role in (cfg.deployment.prefill, cfg.deployment.decode):
            role.num_cpus = 0.5
        # one HTTP front, on the head (both raylets share this machine's ports)
        serve.start(proxy_location="HeadOnly", http_options={"host": cfg.http.host, "port": cfg.http.port})
        reference = build_reference_engine(cfg)  # same seeded weights as the replicas
        with local_app(cfg) as url:
            wait_healthy(url)
            yield {"url": url, "cfg": cfg, "reference": reference, "far_node_id": far.node_id,
                   "far_ip": far.node_ip_address}
    finally:
        ray.shutdown()
        cluster.shutdown()
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = saved


def _node_store(node_id: str):
    from deployments.node_store import node_store_actor_of

    actor = node_store_actor_of(node_id)
    assert actor is not None, f"no node store on {node_id[:12]}"
    return actor


def _store_stats(node_id: str) -> dict:
    import ray

    return ray.get(_node_store(node_id).stats.remote(), timeout=60)


def _decode_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("DecodeServer", APP_NAME).stats.remote().result(timeout_s=60)


def test_decode_loads_the_far_prefill_through_the_grpc_peer(two_nodes):
    url, ref = two_nodes["url"], two_nodes["reference"]
    far = _store_stats(two_nodes["far_node_id"])["grpc"]
    assert far["address"].startswith(two_nodes["far_ip"] + ":"), "bound to the node's interface (bind ':0')"
    before_sent, before_hits = far["num_bytes_sent"], far["num_fetch_hits"]
    prompt = _ids(300, 81)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "session_id": "peer-1", "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    want, _ = ref.generate(EngineRequest("ref-peer-1", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert r.json()["choices"][0]["token_ids"] == want, "greedy output equals the run without any transfer"
    far = _store_stats(two_nodes["far_node_id"])["grpc"]
    assert far["num_fetch_hits"] > before_hits and far["num_bytes_sent"] > before_sent, "state left the far node"
    assert far["num_auth_failures"] == 0
    worker = _decode_stats()["worker"]
    assert worker["peer_loads"] >= 1 and worker["peer_load_failures"] == 0, worker


def test_wrong_token_is_refused_by_a_node_service(two_nodes):
    from kv_transfer.transport import RemoteStore, RemoteStoreConfig

    address = _store_stats(two_nodes["far_node_id"])["grpc"]["address"]
    key = "mla:" + "5a" * 16
    with RemoteStore(RemoteStoreConfig(address, token=TOKEN, timeout_s=30)) as member:
        assert member.put_bytes(key, b"probe")
        assert member.get_bytes(key) == b"probe"
    before = _store_stats(two_nodes["far_node_id"])["grpc"]["num_auth_failures"]
    with RemoteStore(RemoteStoreConfig(address, token="not-" + TOKEN, timeout_s=30)) as stranger:
        assert stranger.get_bytes(key) is None
        assert stranger.put_bytes("mla:" + "a5" * 16, b"planted") is False
        assert stranger.stats()["auth_failures"] == 2
    assert _store_stats(two_nodes["far_node_id"])["grpc"]["num_auth_failures"] == before + 2
    with RemoteStore(RemoteStoreConfig(address, token=TOKEN, timeout_s=30)) as member:
        assert member.contains([key, "mla:" + "a5" * 16]) == [True, False], "nothing was planted"


def test_a_session_evicted_on_the_decode_node_is_resumed_by_the_pool(two_nodes):
    """Turn 1 ends on the head (decode only); other sessions displace it from the decode
    engine's device cache, and newer objects from its node's host tier (LRU), which spills them
    to the far node. Turn 2 is prefilled on the far node from the spilled turn-end state: more
    cached tokens than the far node's own turn-1 prompt state holds, and the reference's tokens."""
    import ray

    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host_ipc import HostTierClient

    url, ref, far_id = two_nodes["url"], two_nodes["reference"], two_nodes["far_node_id"]
    head_id = ray.get_runtime_context().get_node_id()
    prompt = _ids(300, 91)

    def complete(ids: list[int], n: int, session: str) -> dict:
        body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "session_id": session, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    first = complete(prompt, 30, "spill-1")["choices"][0]["token_ids"]  # 330 tokens: 5 full blocks
    for k in range(4):  # 4 x 6 blocks: the first session leaves the decode engine's ~20 blocks
        complete(_ids(330, 100 + k), 4, f"spill-other-{k}")
    head = _node_store(head_id)
    hasher = BlockHasher(64, KeyExtras(ref.model_id))
    client = HostTierClient(ray.get(head.address.remote(), timeout=60))  # the head's host tier, as its replicas see it
    held = StateStore([client], ref.layout, write_behind=False)
    deadline = time.monotonic() + 60  # the turn-end publish runs in the background (disagg.flow step 5)
    while held.resumable_length(prompt + first, hasher).position < 320 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert held.resumable_length(prompt + first, hasher).position >= 320, "turn 1 ended on the decode node"
    capacity = _store_stats(head_id)["host"]["capacity_bytes"]
    chunk = ref.layout.mla_block_bytes()  # newer blocks of other sessions: every older object goes
    for i in range(capacity // chunk):
        assert client.put_bytes(f"mla:{0xF111 + i:032x}", bytes(chunk))
    assert ray.get(head.spill_flush.remote(60), timeout=90)
    assert held.resumable_length(prompt + first, hasher).position == 0, "the decode node holds none of it"
    client.close()
    spill = _store_stats(head_id)["spill"]
    assert spill["target"] == far_id and not spill["in_pool"], spill
    assert spill["num_spilled"] > 0 and spill["num_refused"] == spill["num_dropped"] == 0, spill
    assert _store_stats(far_id)["spill"]["in_pool"], "the far node runs the prefill replica"
    scraped = httpx.get(url + "/metrics", timeout=60).text  # the replicas report their nodes' spill
    spilled = [ln for ln in scraped.splitlines() if ln.startswith('disagg_spill_objects{outcome="spilled"}')]
    assert spilled and float(spilled[0].split()[-1]) >= spill["num_spilled"], spilled

    second = prompt + first + _ids(40, 92)
    out = complete(second, 8, "spill-1")
    want, _ = ref.generate(EngineRequest("ref-spill-1", second, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert out["choices"][0]["token_ids"] == want, "greedy output equals the run without any transfer"
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    print(f"turn 2: {cached} of {len(second)} prompt tokens cached ({out['disagg']['cached_source']})")
    assert cached >= 320, f"resumed from the spilled turn end (5 blocks), not the 300-token prompt: {out['disagg']}"
