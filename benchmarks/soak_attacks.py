"""Attacks on the HTTP edge that ``benchmarks/soak.py`` runs beside its load and faults.

Each attack is an asyncio task from a loopback address of its own (slow bodies, header trickle
and abandoned requests from 127.0.0.2, where the front's per-address connection cap bites;
bursts from 127.0.0.3, so they reach the admission gate; the sessions stay on 127.0.0.1),
starting ``--attack-delay-s`` into the load and running until the soak's end; what it saw is
counted in ``AttackTally``. Slow bodies and header trickle are one shape (``_slow_connections``:
send a head, then drip pieces while no reply has come) with different heads, pieces and pauses:

    slow_bodies      connections that send headers and the first 1 kB of a 100 kB body, then one
                     byte every 2-5 s: each must be answered 408 (or closed) by the edge, and is
                     replaced when it is
    header_trickle   connections that send a request line, then one header line every 2 s: each
                     must be answered 408 (or closed) by the front
    abandoned        non-streamed requests (both endpoints, 1,500 tokens asked) whose client leaves
                     after 1-4 s: queued, in prefill or in decode; each must stop generating
    overload bursts  every ``burst_every_s``, ``burst_size`` short streamed requests at once, more
                     than the admission gate runs and queues: each is served, or refused 503 with
                     Retry-After; nothing else
    /health probe    from 127.0.0.1 every 0.5 s in a process of its own (the load generator's
                     busy event loop would add its own delays), the whole run: its latency
                     before the attacks (sessions only) and during them (goal: P99 < 1 s)

``abandoned_still_running`` is measured once the load has stopped: a last round of abandoned
requests (both endpoints; queued, prefill, decode), then 10 s, then the ingress's running
generations and the engines' running requests (the largest of 8 scrapes: each asks one
replica per role), which must both be 0; ``idle_after_s`` says when both first read 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

ATTACKER = "127.0.0.2"
BURSTER = "127.0.0.3"
MODEL = "disagg-tiny"


@dataclass(slots=True)
class SlowTally:
    """What one slow-connection attack saw (slow bodies, or header trickle)."""

    conns: int = 0  # connections opened
    answered_408: int = 0  # answered 408
    closed: int = 0  # closed without a reply (refused by the per-address cap, or reset)
    seconds: list[float] = field(default_factory=list)  # open -> answered/closed

    def summary(self, name: str) -> dict:
        return {f"{name}_connections": self.conns, f"{name}_answered_408": self.answered_408,
                f"{name}_closed_without_reply": self.closed,
                f"{name}_seconds_max": round(max(self.seconds, default=0), 1)}


@dataclass(slots=True)
class AttackTally:
    slow_body: SlowTally = field(default_factory=SlowTally)
    trickle: SlowTally = field(default_factory=SlowTally)
    abandoned: int = 0  # requests whose client left
    burst_requests: int = 0
    burst_served: int = 0
    burst_shed: int = 0  # 503 with Retry-After
    burst_other: list[str] = field(default_factory=list)  # anything else (goal: none)
    health: list[tuple[float, float, str | None]] = field(default_factory=list)  # (epoch, seconds, failure)
    attacks_from: float = 0.0  # epoch the attacks started

    def summary(self) -> dict:
        return {**self.slow_body.summary("slow_body"), **self.trickle.summary("header_trickle"),
                "abandoned_requests": self.abandoned, "burst_requests": self.burst_requests,
                "burst_served": self.burst_served, "burst_shed_503_retry_after": self.burst_shed,
                "burst_other": self.burst_other[:10], "burst_other_count": len(self.burst_other),
                "health_before_attacks": _percentiles([h for h in self.health if h[0] < self.attacks_from]),
                "health_during_attacks": _percentiles([h for h in self.health if h[0] >= self.attacks_from])}


def _percentiles(probes: list[tuple[float, float, str | None]]) -> dict:
    """P50/P99/max of /health latencies; a failed probe counts as 30 s."""
    hs = sorted(30.0 if why else s for _, s, why in probes)
    if not hs:
        return {"probes": 0}
    p = (lambda q: round(hs[min(len(hs) - 1, int(q * len(hs)))], 3))
    return {"probes": len(hs), "p50_s": p(0.5), "p99_s": p(0.99), "max_s": round(hs[-1], 3),
            "failures": [why for _, _, why in probes if why][:10]}


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))


async def _reply(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(200)
    except OSError:
        return b""


async def _slow_connections(port: int, head: bytes, drip: Callable[[], Iterator[bytes]],
                            pause: Callable[[], float], stop_at: float, tally: SlowTally) -> None:
    """The shape of both slow attacks: open a connection, send ``head``, then the next piece of a
    fresh ``drip()`` every ``pause()`` seconds while no reply has come (and pieces remain); count
    how the edge ended it, and open the next one."""
    while time.monotonic() < stop_at:
        t0 = time.monotonic()
        tally.conns += 1
        try:
            reader, writer = await _open(port)
        except OSError:
            tally.closed += 1
            await asyncio.sleep(1.0)
            continue
        got = b""
        pieces = drip()
        try:
            writer.write(head)
            await writer.drain()
            reading = asyncio.ensure_future(_reply(reader))
            while not reading.done() and time.monotonic() < stop_at + 60:
                await asyncio.wait({reading}, timeout=pause())
                piece = None if reading.done() else next(pieces, None)
                if piece is None:
                    break
                writer.write(piece)
                await writer.drain()
            if not reading.done():  # all sent: the answer may still come
                await asyncio.wait({reading}, timeout=max(0.0, stop_at + 60 - time.monotonic()))
            got = await reading if reading.done() else b""
            reading.cancel()
        except OSError:
            pass
        finally:
            writer.close()
        tally.seconds.append(time.monotonic() - t0)
        if got.startswith(b"HTTP/1.1 408"):
            tally.answered_408 += 1
        else:
            tally.closed += 1
            await asyncio.sleep(1.0)


def _slow_body(port: int, key: str, stop_at: float, tally: AttackTally, rng: random.Random):
    """Headers and 1 kB of a 100 kB body, then one byte every 2-5 s."""
    body = json.dumps({"model": MODEL, "prompt": "x" * 100_000, "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (key.encode(), len(body)))
    return _slow_connections(port, head + body[:1024], lambda: (body[i:i + 1] for i in range(1024, len(body))),
                             lambda: rng.uniform(2.0, 5.0), stop_at, tally.slow_body)


def _header_trickle(port: int, stop_at: float, tally: AttackTally):
    """A request line, then one header line every 2 s."""
    return _slow_connections(port, b"GET /v1/models HTTP/1.1\r\nHost: soak\r\n",
                             lambda: itertools.repeat(b"X-Trickle: 1\r\n"), lambda: 2.0, stop_at, tally.trickle)


def _abandon_body(path: str, rng: random.Random, prompt_tokens: int) -> dict:
    body = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    ids = [rng.randrange(4, 260) for _ in range(prompt_tokens)]
    if path == "/v1/completions":
        return body | {"prompt": ids}
    return body | {"messages": [{"role": "user", "content": "".join(chr(97 + t % 26) for t in ids)}]}


async def abandon(base: str, key: str, path: str, rng: random.Random, prompt_tokens: int, leave_s: float,
                  tally: AttackTally) -> None:
    """One non-streamed request whose client leaves after ``leave_s``."""
    tally.abandoned += 1
    transport = httpx.AsyncHTTPTransport(local_address=ATTACKER)
    async with httpx.AsyncClient(base_url=base, transport=transport) as client:
        try:
            await asyncio.wait_for(client.post(path, json=_abandon_body(path, rng, prompt_tokens),
                                               headers={"Authorization": f"Bearer {key}"}, timeout=60), leave_s)
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass


async def _abandoner(base: str, key: str, stop_at: float, every_s: float, tally: AttackTally,
                     rng: random.Random) -> None:
    paths = ["/v1/completions", "/v1/chat/completions"]
    while time.monotonic() < stop_at:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every_s)
        await abandon(base, key, rng.choice(paths), rng, rng.choice([40, 300, 900]), rng.uniform(1.0, 4.0), tally)


async def _bursts(base: str, key: str, stop_at: float, every_s: float, size: int, tally: AttackTally) -> None:
    limits = httpx.Limits(max_connections=size + 8, max_keepalive_connections=0)
    transport = httpx.AsyncHTTPTransport(local_address=BURSTER, limits=limits)
    async with httpx.AsyncClient(base_url=base, transport=transport, timeout=120) as client:
        while time.monotonic() + every_s < stop_at:
            await asyncio.sleep(every_s)

            async def one(i: int) -> None:
                body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": 4, "ignore_eos": True, "stream": True}
                tally.burst_requests += 1
                try:
                    async with client.stream("POST", "/v1/completions", json=body,
                                             headers={"Authorization": f"Bearer {key}"}) as r:
                        text = (await r.aread()).decode(errors="replace")
                except httpx.HTTPError as exc:
                    tally.burst_other.append(f"transport {type(exc).__name__}")
                    return
                if r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text:
                    tally.burst_served += 1
                elif r.status_code == 503 and r.headers.get("retry-after"):
                    tally.burst_shed += 1
                else:
                    tally.burst_other.append(f"{r.status_code} {text[:120]}")

            await asyncio.gather(*(one(i) for i in range(size)))


def health_probe(base: str, stop_epoch: float, out) -> None:
    """Probe ``/health`` every 0.5 s until ``stop_epoch``; sends (epoch, seconds, failure) tuples
    to the pipe ``out`` at the end. Runs in a process of its own (module docstring)."""
    probes = []
    with httpx.Client(base_url=base, timeout=30) as client:
        while time.time() < stop_epoch:
            t0, m0 = time.time(), time.monotonic()
            try:
                r = client.get("/health")
                why = None if r.status_code == 200 else f"status {r.status_code} {r.text[:80]}"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"[:120]
            probes.append((t0, time.monotonic() - m0, why))
            time.sleep(0.5)
    out.send(probes)
    out.close()


async def start(base: str, key: str, stop_at: float, args, tally: AttackTally) -> list[asyncio.Task]:
    """The attack tasks, from ``args.attack_delay_s`` until ``stop_at`` (their last connections
    end within a minute)."""
    await asyncio.sleep(args.attack_delay_s)
    tally.attacks_from = time.time()
    port = int(base.rsplit(":", 1)[1])
    rng = random.Random(args.seed + 99)
    tasks = [asyncio.create_task(_slow_body(port, key, stop_at, tally, random.Random(rng.random())))
             for _ in range(args.slow_bodies)]
    tasks += [asyncio.create_task(_header_trickle(port, stop_at, tally)) for _ in range(args.header_trickles)]
    if args.abandon_every_s > 0:
        tasks.append(asyncio.create_task(_abandoner(base, key, stop_at, args.abandon_every_s, tally, rng)))
    if args.burst_size > 0:
        tasks.append(asyncio.create_task(_bursts(base, key, stop_at, args.burst_every_s, args.burst_size, tally)))
    return tasks


def _running(metrics: str) -> dict:
    found = {"http_running": 0.0, "engine_running": 0.0}
    for line in metrics.splitlines():
        if line.startswith("disagg_http_running "):
            found["http_running"] = float(line.split()[-1])
        elif re.match(r'disagg_engine_requests\{role="\w+",state="running"\} ', line):
            found["engine_running"] += float(line.split()[-1])
    return found


async def _running_everywhere(client: httpx.AsyncClient, scrapes: int = 8) -> dict:
    """``_running`` at its largest over several scrapes: each asks one replica per role for its
    engine's figures, so one scrape can miss a request on another decode replica."""
    seen = [_running((await client.get("/metrics")).text) for _ in range(scrapes)]
    return {k: max(s[k] for s in seen) for k in seen[0]}


async def final_abandon_check(base: str, key: str, seed: int, tally: AttackTally) -> dict:
    """Abandon a request in each phase on each endpoint with nothing else running, wait 10 s,
    and read what still runs (module docstring)."""
    rng = random.Random(seed)
    rounds = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        # queued behind the others (prefill), prefilling a long prompt, decoding a short one
        rounds += [abandon(base, key, path, rng, n, leave, tally) for n, leave in ((900, 1.0), (900, 2.0), (40, 3.0))]
    await asyncio.gather(*rounds)
    left = time.monotonic()
    await asyncio.sleep(10.0)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        found = await _running_everywhere(client)
        later = found
        while any(later.values()) and time.monotonic() - left < 120:  # how long until nothing runs
            await asyncio.sleep(1.0)
            later = await _running_everywhere(client)
    return {"abandoned": len(rounds), "still_running_after_10_s": found,
            "idle_after_s": round(time.monotonic() - left, 1) if not any(later.values()) else None}
