"""Streamed-text cost per token in the HTTP layer: incremental detokenization against decoding the
whole output on every token (what the stream did before), same tokens, same run.

    python benchmarks/detok_bench.py --lengths 256,1024,4096

For each output length it streams the same token ids (UTF-8 bytes of mixed-width text through
the byte tokenizer, one token per chunk) both ways and prints microseconds per token and the
ratio; both ways must produce the same text.
"""

from __future__ import annotations

import argparse
import random
import time

from disagg.api.detok import IncrementalText
from disagg.engine.reference.tokenizer import ByteTokenizer


def whole(tok, ids: list[int]) -> str:
    """The previous stream: decode everything so far, emit the new suffix."""
    out, text = [], ""
    for i in range(1, len(ids) + 1):
        full = tok.decode(ids[:i])
        if tok.incomplete_tail(ids[:i]):
            continue
        out.append(full[len(text):])
        text = full
    out.append(tok.decode(ids)[len(text):])
    return "".join(out)


def incremental(tok, ids: list[int]) -> str:
    text = IncrementalText(tok)
    out = [text.push([t]) for t in ids]
    out.append(text.flush())
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tok = ByteTokenizer()
    rng = random.Random(0)
    print(f"{'tokens':>7} {'whole us/tok':>13} {'incremental us/tok':>19} {'ratio':>7}")
    for n in [int(x) for x in args.lengths.split(",") if x]:
        ids = tok.encode("".join(rng.choice("abcdefgh é€😀") for _ in range(n)))[:n]
        best = {}
        for fn in (whole, incremental) * args.reps:  # interleaved; best of reps
            t0 = time.perf_counter()
            text = fn(tok, ids)
            dt = time.perf_counter() - t0
            best[fn.__name__] = min(best.get(fn.__name__, dt), dt)
            assert text == tok.decode(ids)
        w, i = (1e6 * best[k] / n for k in ("whole", "incremental"))
        print(f"{n:>7} {w:>13.1f} {i:>19.1f} {w / i:>6.1f}x", flush=True)


if __name__ == "__main__":
    main()
