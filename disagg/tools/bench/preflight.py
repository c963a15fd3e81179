"""Before a benchmark: is the server there, does it serve the model, what prompts fit it.

``probe(url)`` asks ``GET /v1/models`` once, with a short timeout, and either
returns a :class:`ServerInfo` or raises :class:`PreflightError` with one line
that names the problem and the fix (no server, wrong URL, missing API key,
model not served). ``token_params`` fills the prompt-building parameters the
user did not give from the server's ``disagg`` extension of the model card::

    {"id": "disagg-tiny", "max_model_len": 204096,
     "disagg": {"vocab_size": 512, "block_size": 64, "max_model_len": 204096}}

Precedence of each value: the flag, else the server's card, else the fallback
(``FALLBACK_VOCAB_SIZE``, ``DEFAULT_BLOCK_SIZE``: right for no particular
server, so the bench says where each value came from).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE

FALLBACK_VOCAB_SIZE = 32_000  # a server that does not say: token ids below this
FIRST_TOKEN_ID = 100  # prompt ids start here (clear of special tokens) when the vocabulary allows


class PreflightError(Exception):
    """The server cannot run this benchmark; ``str()`` is one line for the user."""


@dataclass(slots=True)
class ServerInfo:
    """What ``GET /v1/models`` says about the server (None: not said)."""

    model: str  # the model the benchmark will request
    models: list[str]  # every id the server lists
    vocab_size: int | None  # valid prompt token ids are [0, vocab_size)
    block_size: int | None  # tokens per cache block
    max_model_len: int | None  # prompt + output token limit


@dataclass(slots=True)
class TokenParams:
    """Prompt-building parameters and where each came from ("flag", "server", "fallback")."""

    vocab_size: int
    first_token_id: int
    block_size: int
    sources: dict[str, str]


def probe(
    url: str, model: str | None = None, api_key: str | None = None, timeout_s: float = 5.0
) -> ServerInfo:
    """``GET url/v1/models``; raises :class:`PreflightError` unless it lists ``model`` (any model
    when None)."""
    base = url.rstrip("/")
    req = urllib.request.Request(base + "/v1/models", headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise PreflightError(
                f"{base} wants an API key: pass --api-key KEY or set OPENAI_API_KEY"
            ) from None
        detail = exc.read()[:200].decode("utf-8", "replace").strip()
        raise PreflightError(
            f"{base}/v1/models answered HTTP {exc.code} ({detail or exc.reason}); "
            "is --url an OpenAI-compatible server?"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, socket.timeout | TimeoutError):
            raise PreflightError(
                f"{base} did not answer within {timeout_s:g} s; is the server up and ready?"
            ) from None
        raise PreflightError(
            f"cannot reach {base} ({_reason(reason)}); start a server first "
            "(disagg serve listens on http://127.0.0.1:8000) or fix --url"
        ) from None
    try:
        cards = [c for c in json.loads(body).get("data", []) if isinstance(c, dict) and "id" in c]
    except (ValueError, AttributeError):
        raise PreflightError(
            f"{base}/v1/models is not an OpenAI model list; is --url the API's base URL?"
        ) from None
    if not cards:
        raise PreflightError(f"{base} serves no model (/v1/models is empty)")
    ids = [str(c["id"]) for c in cards]
    if model is not None and model not in ids:
        raise PreflightError(
            f"model {model!r} is not served at {base}; it serves: {', '.join(ids)} (fix --model)"
        )
    card = cards[ids.index(model)] if model is not None else cards[0]
    ext = card.get("disagg") if isinstance(card.get("disagg"), dict) else {}
    return ServerInfo(
        str(card["id"]),
        ids,
        _int(ext.get("vocab_size")),
        _int(ext.get("block_size")),
        _int(ext.get("max_model_len", card.get("max_model_len"))),
    )


def token_params(
    info: ServerInfo | None,
    vocab_size: int | None = None,
    first_token_id: int | None = None,
    block_size: int | None = None,
) -> TokenParams:
    """The flags' values where given, else the server's, else the fallbacks (module docstring)."""
    sources = {}

    def pick(name: str, flag: int | None, server: int | None, fallback: int) -> int:
        for source, value in (("flag", flag), ("server", server), ("fallback", fallback)):
            if value is not None:
                sources[name] = source
                return value
        raise AssertionError("the fallback is never None")

    vocab = pick("vocab_size", vocab_size, info.vocab_size if info else None, FALLBACK_VOCAB_SIZE)
    block = pick("block_size", block_size, info.block_size if info else None, DEFAULT_BLOCK_SIZE)
    first = pick(
        "first_token_id", first_token_id, None, FIRST_TOKEN_ID if FIRST_TOKEN_ID < vocab else 0
    )
    if not 0 <= first < vocab:
        raise PreflightError(f"--first-token-id {first} must be below the vocabulary size {vocab}")
    return TokenParams(vocab, first, block, sources)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _reason(reason: object) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    return str(reason)
