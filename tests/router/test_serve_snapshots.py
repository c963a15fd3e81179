"""Device snapshots in the Serve adapter credit a resident session up to its turn end.

``deployments.request_router.DeviceSnapshots`` is the adapter's pure part (no
Ray calls): replicas' snapshots go into a real ``PrefixIndex`` and requests get
their tail probes from real ``BlockHasher`` digests, as in ``choose_replicas``.
"""

from __future__ import annotations

import random

from deployments.request_router import DeviceSnapshots
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteRequest
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 16
H = BlockHasher(BS, KeyExtras("tiny-test"))
RNG = random.Random(0)
SESSION = [RNG.randrange(1000) for _ in range(3 * BS + 5)]  # a turn end inside block 4
OTHER = [RNG.randrange(1000) for _ in range(2 * BS + 9)]


def _report(tokens: list[int], with_tail: bool) -> tuple[list[str], list | None]:
    """What a replica reports for one resident session: block digests (and the turn end)."""
    blocks = [h.hex() for h in H.block_hashes(tokens)]
    tail = [len(tokens), H.prefix_digest(tokens, len(tokens)).hex()] if with_tail and len(tokens) % BS else None
    return blocks, tail


def _apply(snaps: DeviceSnapshots, worker: str, sessions: list[list[int]], with_tail: bool = True) -> None:
    reports = [_report(s, with_tail) for s in sessions]
    snaps.apply(worker, [b for b, _ in reports], [t for _, t in reports] if with_tail else None)


def _resume(idx: PrefixIndex, snaps: DeviceSnapshots, prompt: list[int], worker: str) -> tuple[int, str | None]:
    hashes = H.block_hashes(prompt)
    req = RouteRequest("r", "s", hashes, len(prompt), BS, snaps.tail_probes(H, prompt, hashes))
    return idx.resumable(req, worker)


def _index() -> tuple[PrefixIndex, DeviceSnapshots]:
    idx = PrefixIndex()
    for w in ("a", "b"):
        idx.add_worker(w, "n0")
    return idx, DeviceSnapshots(idx)


def test_resident_session_resumes_at_its_turn_end():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION, OTHER])
    next_turn = SESSION + [7] * 30
    assert _resume(idx, snaps, next_turn, "a") == (len(SESSION), "device")
    assert _resume(idx, snaps, next_turn, "b") == (0, None)  # device state is the replica's own
    assert _resume(idx, snaps, OTHER + [1] * 40, "a") == (len(OTHER), "device")


def test_without_reported_tails_the_last_full_block_is_credited():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION], with_tail=False)
    assert _resume(idx, snaps, SESSION + [7] * 30, "a") == (3 * BS, "device")


def test_a_prompt_that_leaves_the_session_inside_the_tail_gets_no_probe():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION])
    diverged = SESSION[:-2] + [SESSION[-2] + 1, SESSION[-1]] + [7] * 30
    hashes = H.block_hashes(diverged)
    assert snaps.tail_probes(H, diverged, hashes) == []
    assert _resume(idx, snaps, diverged, "a") == (3 * BS, "device")
    assert snaps.tail_probes(H, SESSION, H.block_hashes(SESSION)) == []  # the turn end is not inside the prompt


def test_a_new_snapshot_replaces_the_old_one_per_replica():
    idx, snaps = _index()
    _apply(snaps, "a", [SESSION])
    _apply(snaps, "b", [SESSION])
    next_turn = SESSION + [7] * 30
    _apply(snaps, "a", [OTHER])  # a evicted the session; b still holds it
    assert _resume(idx, snaps, next_turn, "a") == (0, None)
    assert _resume(idx, snaps, next_turn, "b") == (len(SESSION), "device")
    _apply(snaps, "b", [])
    assert snaps.tail_probes(H, next_turn, H.block_hashes(next_turn)) == []
    assert _resume(idx, snaps, next_turn, "b") == (0, None)


def test_replica_report_credits_salted_sessions_up_to_their_turn_ends():
    """``deployments.servers.device_snapshot`` is what ``record_routing_stats`` sends; fed through
    ``DeviceSnapshots`` it credits each resident session (under its own salt) to its turn end."""
    from deployments.servers import device_snapshot

    aligned = OTHER[:2 * BS]
    blocks, tails, checkpoints = device_snapshot(H, [("tenant", SESSION), ("", aligned)])
    assert tails[0][0] == len(SESSION) and tails[1] is None  # an aligned turn end needs no tail
    assert blocks[1] == [h.hex() for h in H.block_hashes(aligned)]
    idx, snaps = _index()
    snaps.apply("a", blocks, tails)
    salted = H.with_salt("tenant")
    next_turn = SESSION + [7] * 30
    hashes = salted.block_hashes(next_turn)
    req = RouteRequest("r", "s", hashes, len(next_turn), BS, snaps.tail_probes(salted, next_turn, hashes))
    assert idx.resumable(req, "a") == (len(SESSION), "device")
    assert _resume(idx, snaps, next_turn, "a") == (0, None)  # unsalted digests name other content
    assert _resume(idx, snaps, aligned + [1] * 20, "a") == (len(aligned), "device")


def test_a_resident_session_is_credited_only_where_the_engine_has_a_checkpoint():
    """A turn's output crosses a block boundary where decode took no KDA checkpoint: the index
    must never predict more than the engine really resumes (it has no state at the last full
    block), and predicts it exactly for the next turn and at aligned checkpoints (unaligned ones
    inside a session are not reported: under-predicted). The engine is the real tiny one."""
    from deployments.servers import device_snapshot
    from disagg.engine.protocol import EngineRequest, SamplingParams
    from disagg.engine.reference.config import load_preset
    from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
    from disagg.engine.reference.model import K3ForCausalLM

    bs = 64
    model = K3ForCausalLM.random_init(load_preset("tiny"), seed=0).eval()
    eng = ReferenceEngine(model, "tiny-test", EngineOptions(block_size=bs, max_num_batched_tokens=128,
                                                            checkpoint_interval=bs, cache_budget_bytes=64 << 20,
                                                            max_num_seqs=8))
    prompt = [RNG.randrange(3, 259) for _ in range(100)]
    eng.generate(EngineRequest("t1", prompt, SamplingParams(max_tokens=60, ignore_eos=True), keep_state=True))
    eng.release("t1")
    (_, tokens, positions), = eng.resident_contents()
    assert len(tokens) == 159 and 64 in positions and 128 not in positions  # none where block 2 ends
    hasher = BlockHasher(bs, KeyExtras("tiny-test"))
    blocks, tails, checkpoints = device_snapshot(hasher, eng.resident_contents())
    idx = PrefixIndex()
    idx.add_worker("a")
    snaps = DeviceSnapshots(idx)
    snaps.apply("a", blocks, tails, checkpoints)
    def predicted(tokens_: list[int]) -> int:
        hashes = hasher.block_hashes(tokens_)
        req = RouteRequest("r", "s", hashes, len(tokens_), bs, snaps.tail_probes(hasher, tokens_, hashes))
        return idx.resumable(req, "a")[0]

    assert predicted(tokens + [7] * 20) == eng.resident_match(tokens + [7] * 20)[1] == 159  # the next turn
    assert predicted(tokens[:90] + [6] * 40) == eng.resident_match(tokens[:90] + [6] * 40)[1] == 64
    edited = tokens[:140] + [5] * 30  # the engine resumes at the prompt's end (100, unaligned)
    assert predicted(edited) == 64 <= eng.resident_match(edited)[1] == 100


def _replica(rid: str, stats: dict | None):
    from types import SimpleNamespace

    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)


def _adapter():
    from deployments.request_router import StateAwareRequestRouter

    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    rr.initialize_state()
    return rr


def test_a_replica_seen_before_its_first_report_joins_its_node():
    """Registered as its own node before it reported one, a replica moves to its node on the
    report, so it can resume from that node's host tier."""
    import time

    from tests.router.helpers import Ev, chain

    rr = _adapter()
    rep = _replica("r0", None)
    rr._sync(rep)
    rep.routing_stats = {"role": "decode", "node_id": "node-A", "time": time.time(), "load": {}}
    assert rr._sync(rep).node_id == "node-A"
    h = chain(4)
    for d in h:  # node-A's store reports its host tier by the node id
        rr._index.apply(Ev("stored", f"mla:{d.hex()}", "host", "node-A", "mla"))
    rr._index.apply(Ev("stored", f"kda:{h[3].hex()}", "host", "node-A", "kda"))
    assert rr._index.resumable(RouteRequest("q", "", h, 17, 4), "r0") == (16, "host")


def test_the_adapters_own_predictions_count_against_replica_reports():
    """Replicas stamp reports with wall time; the policy books predictions on its own clock. A
    request routed after the last report must count in the effective load."""
    import time

    from tests.router.helpers import chain

    rr = _adapter()
    stats = {"role": "decode", "time": time.time() - 0.5, "load": {"queued_prefill_tokens": 0}}
    workers = [rr._sync(_replica(f"r{i}", dict(stats, node_id=f"n{i}"))) for i in range(2)]
    req = RouteRequest("q1", "", chain(1000), 4001, 4)
    decision = rr._policy.route(req, workers)
    rr._policy.on_routed(req, decision)
    loads = rr._policy.effective_loads(workers, rr._policy.clock())
    assert loads[decision.decode_worker].prefill_tokens > 3000


def test_a_decode_replicas_inbound_requests_reach_the_worker_state():
    """A decode replica reports the requests whose prefill runs in the pool (``disagg.flow`` NOTE 15)
    beside its engine's load; the adapter passes them on, and Ray Serve's queue length counts them."""
    import time

    rr = _adapter()
    load = {"running_decode_requests": 1, "running_decode_tokens": 500, "inbound_decode_requests": 2,
            "inbound_decode_tokens": 900}
    ws = rr._sync(_replica("d0", {"role": "decode", "node_id": "n0", "time": time.time(), "load": load}))
    assert (ws.running_decode_requests, ws.inbound_decode_requests, ws.inbound_decode_tokens) == (1, 2, 900)
    assert ws.queue_length == 3
    old = rr._sync(_replica("d1", {"role": "decode", "node_id": "n0", "time": time.time(), "load": {}}))
    assert (old.inbound_decode_requests, old.inbound_decode_tokens) == (0, 0)  # a replica that does not say
