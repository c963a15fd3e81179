"""``disagg demo``: serve the embedded default, run multi-turn sessions, report, stop.

Each session sends a growing conversation (a shared system prefix, its own
context, then the previous turn's output plus a new user message), streams the
reply over the OpenAI API and records TTFT and cached tokens. At the end the
server's ``/metrics`` tell where prompt state came from (device, host tier,
disk, peer, or computed).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx

from disagg.config import AppConfig
from disagg.launch.local import local_app


async def _turn(client: httpx.AsyncClient, model: str, prompt: list[int], session: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "session_id": session,
            "return_token_ids": True}
    t0 = time.perf_counter()
    ttft = None
    text = ""
    ids: list[int] = []
    usage = {}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            for ch in event.get("choices", []):
                if ch.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - t0
                text += ch.get("text", "")
                ids.extend(ch.get("token_ids") or [])
    return {"ttft_ms": 1000 * (ttft or 0), "e2e_ms": 1000 * (time.perf_counter() - t0), "usage": usage,
            "text": text, "token_ids": ids}


async def _session(client, model, idx, system, turns, context, max_tokens, rows):
    rng = random.Random(idx)
    prompt = system + [rng.randrange(3, 259) for _ in range(context)]
    for turn in range(turns):
        r = await _turn(client, model, prompt, f"demo-{idx}", max_tokens)
        rows.append((idx, turn + 1, len(prompt), r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
                     r["ttft_ms"], r["e2e_ms"]))
        # next turn: the whole conversation so far, the reply, and a new user message
        prompt = prompt + r["token_ids"] + [rng.randrange(3, 259) for _ in range(64)]


def _sources(metrics_text: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^disagg_prompt_tokens_total\{source="(\w+)"\} ([0-9.e+]+)$', metrics_text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def run_demo(cfg: AppConfig, num_sessions: int = 3, num_turns: int = 3, context_tokens: int = 1024,
             max_tokens: int = 16) -> int:
    print(f"starting a local Ray cluster: {cfg.deployment.mode} serving of {cfg.model.openai_name} ...", flush=True)
    with local_app(cfg) as url:
        rows: list[tuple] = []

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                for _ in range(600):  # wait for the replicas to come up
                    try:
                        if (await client.get("/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.5)
                system = [random.Random(0).randrange(3, 259) for _ in range(256)]
                await asyncio.gather(*(
                    _session(client, cfg.model.openai_name, i, system, num_turns, context_tokens, max_tokens,
                             rows) for i in range(num_sessions)))
                return (await client.get("/metrics")).text

        metrics = asyncio.run(main())
    print(f"\n{'session':>7} {'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>8} {'E2E ms':>8}")
    for s, t, n, c, ttft, e2e in sorted(rows):
        print(f"{s:>7} {t:>4} {n:>7} {c:>7} {ttft:>8.1f} {e2e:>8.1f}")
    src = _sources(metrics)
    total = sum(src.values()) or 1
    print("\nprompt tokens by where their state came from:")
    for k in ("device", "host", "disk", "peer", "computed"):
        print(f"  {k:>8}: {int(src.get(k, 0)):>8}  ({100 * src.get(k, 0) / total:5.1f}%)")
    later = [r for r in rows if r[1] > 1]
    ok = bool(later) and all(r[3] > 0 for r in later)
    print("\nlater turns resumed their state" if ok else "\nWARNING: a later turn recomputed its context")
    return 0 if ok else 1
