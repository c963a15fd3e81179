"""Log probabilities in OpenAI's two shapes, from the engine's ``TokenLogprob`` per token.

Completions (``logprobs: k``, the legacy shape)::

    {"tokens": ["He", "llo"], "token_logprobs": [-0.1, -2.3],
     "top_logprobs": [{"He": -0.1, "A": -2.9}, ...], "text_offset": [0, 2]}

Chat (``logprobs: true, top_logprobs: k``)::

    {"content": [{"token": "He", "logprob": -0.1, "bytes": [72, 101],
                  "top_logprobs": [{"token": "He", "logprob": -0.1, "bytes": [72, 101]}, ...]}, ...]}

A token's string is its own decoding (a byte-level token inside a multi-byte character decodes
to U+FFFD, as in vLLM); the values are the model's distribution before temperature and top-p.
Streamed, each event carries the entries of the tokens it reports.
"""

from __future__ import annotations

from disagg.engine.protocol import TokenLogprob


def completion_logprobs(tok, ids: list[int], entries: list[TokenLogprob], offset: int) -> dict:
    """The completions shape for ``ids`` (each with its entry); ``offset``: where their text starts."""
    tokens = [tok.decode([t]) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [_first_per_text(tok, e.top) for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def _first_per_text(tok, pairs: list[tuple[int, float]]) -> dict[str, float]:
    """``{text: logprob}``; tokens that decode alike keep the likeliest's value (the dict has one key)."""
    out: dict[str, float] = {}
    for token_id, logprob in pairs:
        out.setdefault(tok.decode([token_id]), logprob)
    return out


def chat_logprobs(tok, ids: list[int], entries: list[TokenLogprob]) -> dict:
    """The chat shape for ``ids`` (each with its entry)."""
    return {"content": [{**_token(tok, t, e.logprob), "top_logprobs": [_token(tok, a, lp) for a, lp in e.top]}
                        for t, e in zip(ids, entries, strict=True)]}


def _token(tok, token_id: int, logprob: float) -> dict:
    text = tok.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}
