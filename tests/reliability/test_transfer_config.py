"""``transfer.grpc`` turned into the node's state service and its peers' clients
(``deployments.node_store.grpc_server_config`` / ``grpc_client_config``): the token from the
environment, mutual TLS from the PEM paths, the message limit, the bind address. Real servers and
clients on loopback; no Ray cluster (tests/reliability/test_grpc_peer_ray.py runs the wired path).
"""

from __future__ import annotations

import datetime
import ipaddress

import pytest

from deployments.node_store import advertised_address, grpc_client_config, grpc_server_config
from disagg.config import GrpcConfig
from disagg.flow import FlowOptions
from disagg.router.decider import DeciderConfig
from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport import RemoteStore, StateServer

TOKEN = "cfg-token-93b1"
KEY = "mla:" + "ab" * 16


@pytest.fixture
def token_env(monkeypatch):
    monkeypatch.setenv("DISAGG_TEST_TRANSFER_TOKEN", TOKEN)
    return "DISAGG_TEST_TRANSFER_TOKEN"


@pytest.mark.parametrize("fields, message", [
    ({"bind": "127.0.0.1"}, "host:port"),
    ({"bind": "127.0.0.1:http"}, "host:port"),
    ({"bind": "127.0.0.1:70000"}, "host:port"),
    ({"tls_cert": "c.pem"}, "go together"),
    ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "tls_ca"),
    ({"tls_ca": "ca.pem"}, "tls_ca"),
    ({"max_message_mb": 2}, "at least 3"),
    ({"deadline_s": 0}, "deadline_s"),
])
def test_bad_grpc_settings_are_refused_when_loaded(fields, message):
    with pytest.raises(ValueError, match=message):
        GrpcConfig(**fields)


def test_enabled_without_the_secret_in_the_environment_is_an_error(monkeypatch):
    monkeypatch.delenv("DISAGG_TEST_MISSING_TOKEN", raising=False)
    g = GrpcConfig(enabled=True, token_env="DISAGG_TEST_MISSING_TOKEN")
    with pytest.raises(ValueError, match=r"\$DISAGG_TEST_MISSING_TOKEN"):
        grpc_server_config(g, "127.0.0.1")
    with pytest.raises(ValueError, match=r"\$DISAGG_TEST_MISSING_TOKEN"):
        grpc_client_config(g, "127.0.0.1:1")


def test_unreadable_pem_is_named_in_the_error(token_env, tmp_path):
    g = GrpcConfig(token_env=token_env, tls_cert=str(tmp_path / "none.pem"), tls_key="k", tls_ca="ca")
    with pytest.raises(ValueError, match="tls_cert .*none.pem"):
        grpc_server_config(g, "127.0.0.1")


def test_bind_and_advertised_address(token_env):
    assert grpc_server_config(GrpcConfig(token_env=token_env, bind=":7070"), "10.1.2.3").address == "10.1.2.3:7070"
    assert grpc_server_config(GrpcConfig(token_env=token_env), "10.1.2.3").address == "127.0.0.1:0"
    assert advertised_address("0.0.0.0:0", 41234, "10.1.2.3") == "10.1.2.3:41234"
    assert advertised_address("127.0.0.2:0", 41234, "10.1.2.3") == "127.0.0.2:41234"


def test_message_limit_applies_on_both_ends(token_env):
    g = GrpcConfig(token_env=token_env, max_message_mb=3)
    server_cfg, client_cfg = grpc_server_config(g, "127.0.0.1"), grpc_client_config(g, "127.0.0.1:1")
    assert server_cfg.max_message_bytes == client_cfg.max_message_bytes == 3 << 20
    assert server_cfg.chunk_bytes == client_cfg.chunk_bytes <= 2 << 20
    assert client_cfg.timeout_s == g.deadline_s


def test_token_from_the_environment_is_required_by_the_served_tier(token_env, monkeypatch):
    g = GrpcConfig(token_env=token_env)
    store = DictByteStore()
    store.put_bytes(KEY, b"state")
    server = StateServer(store, grpc_server_config(g, "127.0.0.1"))
    port = server.start()
    try:
        address = advertised_address(server.config.address, port, "127.0.0.1")
        with RemoteStore(grpc_client_config(g, address)) as peer:
            assert peer.get_bytes(KEY) == b"state"
        monkeypatch.setenv(token_env, "not-the-secret")
        with RemoteStore(grpc_client_config(g, address)) as stranger:
            assert stranger.get_bytes(KEY) is None and stranger.stats()["auth_failures"] == 1
            assert stranger.put_bytes("mla:" + "cd" * 16, b"planted") is False
        assert server.stats().num_auth_failures == 2 and store.keys() == [KEY]
    finally:
        server.stop(0)


# -- mutual TLS from the PEM paths ---------------------------------------------------------------
x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _cert(name: str, issuer=None, *, ca: bool = False):
    """(key, cert): a CA (self-signed) or a node certificate for 127.0.0.1 signed by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[1].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, builder.sign(issuer[0] if issuer else key, hashes.SHA256())


def _write_node_pki(directory, ca, name: str) -> dict[str, str]:
    key, cert = _cert(name, ca)
    paths = {"tls_cert": directory / f"{name}.pem", "tls_key": directory / f"{name}.key",
             "tls_ca": directory / f"{name}-ca.pem"}
    paths["tls_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["tls_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    paths["tls_ca"].write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    return {k: str(v) for k, v in paths.items()}


def test_nodes_talk_mutual_tls_and_refuse_a_node_of_another_ca(token_env, tmp_path):
    cluster_ca, other_ca = _cert("cluster-ca", ca=True), _cert("other-ca", ca=True)
    node_a = GrpcConfig(token_env=token_env, **_write_node_pki(tmp_path, cluster_ca, "node-a"))
    node_b = GrpcConfig(token_env=token_env, **_write_node_pki(tmp_path, cluster_ca, "node-b"))
    outsider = GrpcConfig(token_env=token_env, **_write_node_pki(tmp_path, other_ca, "outsider"))
    store = DictByteStore()
    store.put_bytes(KEY, b"state")
    server = StateServer(store, grpc_server_config(node_a, "127.0.0.1"))
    assert server.config.tls is not None and server.config.tls.client_ca is not None, "mutual TLS"
    port = server.start()
    address = f"127.0.0.1:{port}"
    try:
        with RemoteStore(grpc_client_config(node_b, address)) as peer:
            assert peer.get_bytes(KEY) == b"state"
        with RemoteStore(grpc_client_config(outsider, address)) as stranger:  # right token, wrong CA
            assert stranger.get_bytes(KEY) is None
        with RemoteStore(grpc_client_config(GrpcConfig(token_env=token_env), address)) as plaintext:
            assert plaintext.get_bytes(KEY) is None
        assert server.stats().num_fetch_hits == 1
    finally:
        server.stop(0)


# -- the decode worker's peer path, in process -----------------------------------------------------
@pytest.mark.parametrize("peer_token", [TOKEN, "not-the-secret"])
def test_decode_worker_loads_a_far_prefill_through_the_peer_store(token_env, monkeypatch, peer_token):
    """The worker side of the wiring with real gRPC on loopback (no Ray): a prefill worker on node
    "far" publishes into its own host tier, served with the token; the decode worker on node "here"
    loads the handle through ``peer_stores("far")``. With a wrong token the load is refused and
    the prompt recomputed; both outputs equal the reference engine's."""
    import asyncio
    import random

    import torch

    from disagg.config import load_config
    from disagg.engine.async_engine import AsyncEngine
    from disagg.engine.factory import build_reference_engine
    from disagg.engine.protocol import EngineRequest, SamplingParams
    from disagg.engine.reference.engine import ReferenceEngine
    from disagg.messages import GenerateParams
    from disagg.workers.tiered import StatefulWorker
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    g = GrpcConfig(token_env=token_env)
    far_tier = HostTier(64 << 20, pin_memory=False)
    server = StateServer(far_tier, grpc_server_config(g, "127.0.0.1"))
    port = server.start()
    monkeypatch.setenv(token_env, peer_token)  # what the decode node holds
    remote = RemoteStore(grpc_client_config(g, f"127.0.0.1:{port}"))
    here_tier = HostTier(64 << 20, pin_memory=False)
    peer_store = StateStore([here_tier, remote], engine.layout, write_behind=False)

    def copy():
        return AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options))

    far = StatefulWorker(copy(), StateStore([far_tier], engine.layout), "prefill-far", "far")
    here = StatefulWorker(copy(), StateStore([here_tier], engine.layout), "decode-here", "here",
                          options=FlowOptions(DeciderConfig(local_prefill_max_tokens=64)), peer_stores=lambda node: peer_store if node == "far" else None)
    prompt = [random.Random(91).randrange(4, 260) for _ in range(150)]  # past local_prefill_max_tokens
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)

    async def generate():
        out = []
        async for chunk in here.generate(GenerateParams("r1", prompt, sampling), far.prefill):
            out.extend(chunk.token_ids)
        await here.drain()
        return out

    try:
        got = asyncio.run(generate())
        want, _ = ReferenceEngine(engine.model, engine.model_id, engine.options).generate(
            EngineRequest("ref", prompt, sampling))
        assert got == want
        assert far.counters["prefills"] == 1 and here.counters["remote_prefills"] == 1
        if peer_token == TOKEN:
            assert here.counters["peer_loads"] == 1 and here.counters["load_failures"] == 0
            assert server.stats().num_fetch_hits > 0 and peer_store.stats()["num_promoted"] > 0
        else:
            assert here.counters["peer_load_failures"] == 1 and remote.stats()["auth_failures"] >= 1
            assert server.stats().num_fetch_hits == 0 and server.stats().num_auth_failures >= 1
    finally:
        server.stop(0)
        remote.close()
        for w in (far, here):
            w.engine.shutdown()
        torch.set_num_threads(threads)
