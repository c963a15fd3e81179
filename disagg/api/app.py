"""The OpenAI-compatible HTTP surface, independent of Ray.

``create_app(backend, http_config)`` returns a FastAPI app serving
``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE), ``/v1/models``,
``/health`` and ``/metrics``. The backend does the generation: in the Serve
ingress it routes to prefill/decode replicas; in tests and the overhead
baseline it is an in-process engine.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
with the matching status: 400 bad parameters / context length, 401 missing or
wrong API key, 404 unknown model, 413 oversize body, 503 overloaded.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from disagg.api.errors import APIError, error_response
from disagg.api.metrics import ServingMetrics
from disagg.api.schemas import ChatCompletionRequest, CompletionRequest
from disagg.config import HTTPConfig
from disagg.engine.protocol import SamplingParams
from disagg.messages import GenerateParams, StreamChunk


class GenerationBackend(Protocol):
    model_name: str  # the served OpenAI model name
    max_model_len: int  # prompt + max_tokens limit
    tokenizer: Any  # encode / decode / apply_chat_template / eos_token_id

    def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]: ...

    async def stats(self) -> dict: ...


def create_app(backend: GenerationBackend, http: HTTPConfig | None = None, metrics: ServingMetrics | None = None) -> FastAPI:
    http = http or HTTPConfig()
    metrics = metrics or ServingMetrics()
    app = FastAPI(title="disagg", version="0.1.0")
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(APIError(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
                                       param=loc or None))

    @app.middleware("http")
    async def _limits_and_auth(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            length = request.headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > http.max_body_bytes):
                return error_response(APIError(413, f"request body exceeds {http.max_body_bytes} bytes",
                                               type="invalid_request_error", code="body_too_large"))
            if http.api_keys and not _authorized(request.headers.get("authorization", ""), http.api_keys):
                return error_response(APIError(401, "missing or invalid API key",
                                               type="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model",
                                            "owned_by": "disagg", "max_model_len": backend.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        try:
            metrics.observe_stats(await asyncio.wait_for(backend.stats(), timeout=5))
        except Exception:  # stats are best effort; the scrape still answers
            pass
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        tok = backend.tokenizer
        if isinstance(body.prompt, str):
            ids = tok.encode(body.prompt)
        elif isinstance(body.prompt[0], str):
            ids = tok.encode(body.prompt[0])
        else:
            ids = list(body.prompt)
        return await _serve(body, ids, "text_completion", request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        text = backend.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        return await _serve(body, backend.tokenizer.encode(text), "chat.completion", request)

    async def _serve(body, ids: list[int], kind: str, request: Request):
        if body.model != backend.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {backend.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        vocab = getattr(backend, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else max(1, backend.max_model_len - len(ids))
        if len(ids) + max_tokens > backend.max_model_len:
            raise APIError(400, f"this model's maximum context length is {backend.max_model_len} tokens; "
                           f"the request asks for {len(ids)} prompt + {max_tokens} completion tokens",
                           param="max_tokens", code="context_length_exceeded")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                      seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()),
                                      ignore_eos=body.ignore_eos)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        params = GenerateParams(
            request_id=f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
            prompt_token_ids=ids, sampling=sampling, session_id=body.session_id or body.user,
            cache_salt=body.cache_salt or _salt_for(request, http))
        run = _Run(backend, metrics, params, stops, kind, body.model, body.return_token_ids)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(run.sse(usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await run.whole())

    return app


def _authorized(header: str, keys: list[str]) -> bool:
    token = header[7:] if header.lower().startswith("bearer ") else ""
    ok = False
    for k in keys:  # compare against every key: time does not depend on which one matched
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return ok


def _salt_for(request: Request, http: HTTPConfig) -> str:
    """Tenant salt: per API key when keys are configured (NOTE: never the key itself)."""
    if not http.api_keys:
        return ""
    token = request.headers.get("authorization", "")[7:]
    return hmac.new(b"disagg-cache-salt", token.encode(), "sha256").hexdigest()[:32]


class _Run:
    """One request's generation, shaped as OpenAI JSON or SSE."""

    def __init__(self, backend, metrics: ServingMetrics, params: GenerateParams, stops: list[str], kind: str,
                 model: str, return_token_ids: bool = False):
        self.backend, self.metrics, self.params = backend, metrics, params
        self.stops, self.kind, self.model = stops, kind, model
        self.return_token_ids = return_token_ids
        self._sent_ids = 0
        self.created = int(time.time())
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.last: StreamChunk | None = None

    async def _pieces(self) -> AsyncIterator[str]:
        """Yields new text; stops at a stop string; raises APIError on engine errors."""
        tok = self.backend.tokenizer
        t0 = time.perf_counter()
        t_prev = None
        agen = self.backend.stream(self.params)
        try:
            async for chunk in agen:
                self.last = chunk
                if chunk.error:
                    self.metrics.request_done(self.kind, "error")
                    raise APIError(500 if chunk.finish_reason == "error" else 503, chunk.error,
                                   type="server_error")
                if chunk.token_ids:
                    now = time.perf_counter()
                    if t_prev is None:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - t_prev) / len(chunk.token_ids))
                    t_prev = now
                    self.ids.extend(chunk.token_ids)
                    full = tok.decode(self.ids)
                    if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more bytes
                        new = ""
                    else:
                        new, self.text = full[len(self.text):], full
                    cut = _find_stop(self.text, self.stops)
                    if cut is not None:
                        new = new[: max(0, len(new) - (len(self.text) - cut))]
                        self.text = self.text[:cut]
                        self.finish_reason = "stop"
                        if new:
                            yield new
                        break
                    yield new  # may be "" while a UTF-8 sequence is incomplete
                if chunk.finished:
                    self.finish_reason = chunk.finish_reason
                    break
        finally:
            await agen.aclose()
        self.metrics.e2e.observe(time.perf_counter() - t0)
        self.metrics.request_finished(self.kind, self.last, len(self.ids))

    def _usage(self) -> dict:
        last = self.last
        prompt = len(self.params.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids),
                "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens if last else 0}}

    def _choice(self, text: str, finish: str | None, delta: bool) -> dict:
        if self.kind == "chat.completion":
            body = {"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}
            choice = {"index": 0, **body, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.return_token_ids:
            choice["token_ids"] = self.ids[self._sent_ids:] if delta else list(self.ids)
            self._sent_ids = len(self.ids)
        return choice

    async def whole(self) -> dict:
        async for _ in self._pieces():
            pass
        body = {"id": self.params.request_id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self._choice(self.text, self.finish_reason, delta=False)], "usage": self._usage()}
        if self.last is not None:  # extension: where the request ran and where its prompt state came from
            body["disagg"] = {"replica": self.last.replica_id, "cached_source": self.last.cached_source}
        return body

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        head = {"id": self.params.request_id, "object": obj, "created": self.created, "model": self.model}
        try:
            if self.kind == "chat.completion":
                first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                yield _sse(first)
            async for piece in self._pieces():
                if piece or self.return_token_ids:
                    yield _sse({**head, "choices": [self._choice(piece, None, delta=True)]})
            yield _sse({**head, "choices": [self._choice("", self.finish_reason, delta=True)]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage()})
        except APIError as exc:
            yield _sse({"error": exc.body()})
        yield b"data: [DONE]\n\n"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
