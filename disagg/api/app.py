"""The OpenAI-compatible HTTP surface, independent of Ray.

``create_app(backend, http_config)`` returns a FastAPI app serving
``/v1/completions``, ``/v1/chat/completions`` (JSON or SSE), ``/v1/models``
(and ``/v1/models/{id}``), ``/health``, ``/metrics`` and, an extension, ``DELETE
/v1/sessions/{id}`` (a session is over: ``disagg.flow`` NOTE 14). Stop strings never
reach the client, streamed or not (text that may start one is held until the
next piece decides), and a non-streamed request whose client disconnects is
aborted. A request of ``n`` choices runs one ``_Run`` per choice, answered as one
``_Response`` (``disagg.api.choices``). The backend does the generation: in the Serve
ingress it routes to prefill/decode replicas; in tests and the overhead
baseline it is an in-process engine.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
with the matching status: 400 bad parameters / context length, 401 missing or
wrong API key, 404 unknown model or route, 413 oversize body, 429 per-key rate
or concurrency limit, 501 a session ended on a backend without sessions, 503 overloaded
(load shed) or no replica left, 500 a bug.
Keys, limits and load shedding live in ``disagg.api.limits`` (an ASGI
middleware that sees the whole life of a streamed response).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from disagg.api.choices import choice_params, merged, summed_usage
from disagg.api.detok import IncrementalText
from disagg.api.errors import APIError, error_response
from disagg.api.limits import (
    AdmissionGate,
    EdgeMiddleware,
    KeyLimiter,
    KeyTable,
    request_salt,
    tenant_salt,
    unless_disconnected,
)
from disagg.api.logprobs import chat_logprobs, completion_logprobs
from disagg.api.metrics import ServingMetrics
from disagg.api.schemas import (
    MAX_FIELD_CHARS,
    UNSERVED_WHY,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    unserved,
)
from disagg.config import HTTPConfig
from disagg.engine.protocol import SamplingParams
from disagg.messages import GenerateParams, StreamChunk

log = logging.getLogger(__name__)
_ERRORS = {400: "bad parameters or context length", 401: "missing or invalid API key", 404: "unknown model",
           408: "the request body did not arrive in time", 413: "request body too large", 429: "per-key rate or concurrency limit (see Retry-After)",
           501: "not available on this server's backend", 503: "overloaded or no replica available (see Retry-After)"}


class GenerationBackend(Protocol):
    model_name: str  # the served OpenAI model name
    max_model_len: int  # prompt + max_tokens limit
    tokenizer: Any  # encode / decode / apply_chat_template / eos_token_id

    def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]: ...

    async def stats(self) -> dict: ...


def create_app(backend: GenerationBackend, http: HTTPConfig | None = None, metrics: ServingMetrics | None = None) -> FastAPI:
    http = (http or HTTPConfig()).with_file_keys()  # keys from a mounted Secret join the inline ones
    metrics = metrics or ServingMetrics()
    # No /docs or /redoc (their pages load assets from a CDN); /openapi.json only where
    # configured, behind the key like /v1/* (limits.PROTECTED_PATHS).
    app = FastAPI(title="disagg", version="0.1.0", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if http.openapi else None)
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _bug(_req: Request, exc: Exception):  # still logged by Starlette; the client gets JSON
        return error_response(APIError(500, "internal error", type="server_error", code="internal_error"))

    gate = AdmissionGate(http.max_inflight, http.max_queued, http.queue_timeout_s)
    app.state.gate = gate
    app.add_middleware(EdgeMiddleware, max_body_bytes=http.max_body_bytes, keys=KeyTable(http.api_keys),
                       limiter=KeyLimiter(http.rate_limit_per_key, http.rate_burst_per_key,
                                          http.max_concurrent_per_key),
                       gate=gate, on_reject=metrics.rejected, body_timeout_s=http.body_timeout_s, max_n=http.max_n)
    app.openapi = lambda: _openapi(app, bool(http.api_keys))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": backend.model_name}

    started = int(time.time())

    def model_card() -> dict:
        card = {"id": backend.model_name, "object": "model", "created": started, "owned_by": "disagg",
                "max_model_len": backend.max_model_len}
        # extension: what a client needs to build valid token-ID prompts (disagg bench reads it)
        card["disagg"] = {"max_model_len": backend.max_model_len, "vocab_size": getattr(backend, "vocab_size", None),
                          "block_size": getattr(backend, "block_size", None)}
        return card

    @app.get("/v1/models", responses={401: {"model": ErrorResponse, "description": _ERRORS[401]}})
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", responses={401: {"model": ErrorResponse, "description": _ERRORS[401]},
                                                   404: {"model": ErrorResponse, "description": _ERRORS[404]}})
    async def model(model: str):
        _check_model(model)
        return model_card()

    def _check_model(name: str) -> None:
        if name != backend.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {backend.model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prom():
        try:
            metrics.observe_stats(await asyncio.wait_for(backend.stats(), timeout=5))
        except Exception:  # stats are best effort; the scrape still answers
            pass
        metrics.observe_gate(gate)
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.post("/v1/completions", responses=_error_responses())
    async def completions(body: CompletionRequest, request: Request):
        tok = backend.tokenizer
        if isinstance(body.prompt, str):
            ids = _encode(tok, body.prompt, "prompt")
        elif isinstance(body.prompt[0], str):
            ids = _encode(tok, body.prompt[0], "prompt")
        else:
            ids = list(body.prompt)
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else (
                body.prompt[0] if isinstance(body.prompt[0], str) else tok.decode(ids))
        return await _serve(body, ids, "text_completion", request, echo, body.logprobs)

    @app.post("/v1/chat/completions", responses=_error_responses())
    async def chat(body: ChatCompletionRequest, request: Request):
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        text = backend.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        return await _serve(body, _encode(backend.tokenizer, text, "messages"), "chat.completion", request,
                            num_logprobs=(body.top_logprobs or 0) if body.logprobs else None)

    @app.delete("/v1/sessions/{session_id:path}",
                responses={401: {"model": ErrorResponse, "description": _ERRORS[401]},
                           400: {"model": ErrorResponse, "description": _ERRORS[400]},
                           429: {"model": ErrorResponse, "description": _ERRORS[429]},
                           501: {"model": ErrorResponse, "description": _ERRORS[501]}})
    async def end_session(session_id: str, request: Request, cache_salt: str | None = None):
        """Extension: the session (the ``session_id`` or ``user`` its requests sent) is over; its state
        goes first from the serving tiers (``disagg.flow`` NOTE 14). For a client that learns of the end
        after its last turn; one that knows it sends ``session_end`` with that turn."""
        end = getattr(backend, "end_session", None)
        if end is None:
            raise APIError(501, "this server's backend keeps no session state to end", type="server_error",
                           code="not_implemented")
        if not session_id:
            raise APIError(400, "name the session to end: DELETE /v1/sessions/{session_id}", param="session_id")
        for name, value in (("session_id", session_id), ("cache_salt", cache_salt or "")):
            if len(value) > MAX_FIELD_CHARS:
                raise APIError(400, f"{name} must be at most {MAX_FIELD_CHARS} characters", param=name)
        demoted = await end(session_id, _cache_salt(request, cache_salt))
        return {"id": session_id, "object": "session", "ended": True, "demoted_objects": demoted}

    async def _serve(body, ids: list[int], kind: str, request: Request, echo: str = "",
                     num_logprobs: int | None = None):
        _check_model(body.model)
        refused = unserved(body)
        if refused is not None:
            raise APIError(400, f"{refused} is not supported: {UNSERVED_WHY.get(refused, 'this server does not serve it')}",
                           param=refused, code="unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        n = body.n or 1
        if n > http.max_n:
            raise APIError(400, f"n must be at most {http.max_n} (this server's http.max_n)", param="n")
        best_of = getattr(body, "best_of", None) or 1
        if best_of not in (1, n):  # best_of = n is n; best_of = 1 is the default beside any n
            raise APIError(400, f"best_of {best_of} is not supported: {UNSERVED_WHY['best_of']}", param="best_of",
                           code="unsupported_parameter")
        if body.session_end and not (body.session_id or body.user):
            raise APIError(400, "session_end needs the session it ends: set session_id (or user)",
                           param="session_end")
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
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
                                      ignore_eos=body.ignore_eos, logprobs=num_logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        params = GenerateParams(
            request_id=f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
            prompt_token_ids=ids, sampling=sampling, session_id=body.session_id or body.user,
            session_end=bool(body.session_end), cache_salt=_cache_salt(request, body.cache_salt))
        runs = [_Run(backend, metrics, p, stops, kind, body.model, body.return_token_ids, echo, index=i)
                for i, p in enumerate(choice_params(params, n))]
        response = _Response(runs, params.request_id, kind, body.model)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(response.sse(usage), media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        whole = await unless_disconnected(response.whole(), request.receive)  # an abandoned request must not
        if whole is None:  # hold its engine slot and key concurrency: nobody is left to read it
            metrics.request_done(kind, "cancelled")
            return Response(status_code=499)
        return JSONResponse(whole)

    return app


def _encode(tok, text: str, param: str) -> list[int]:
    """Token ids of ``text``; a 400 for text that is not valid Unicode (JSON can carry a lone
    surrogate, ``"\\ud800"``, which no UTF-8 tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode: {exc.reason} at position {exc.start}",
                       param=param) from exc
    return tok.encode(text)


def _cache_salt(request: Request, explicit: str | None) -> str:
    """The tenant's salt (from its API key, never the key itself), narrowed by an explicit one."""
    api_key = request.scope.get("state", {}).get("api_key")
    return request_salt(tenant_salt(api_key) if api_key else "", explicit)


def _error_responses() -> dict:
    ok = {200: {"description": "the completion (JSON), or its chunks as server-sent events when stream is true",
                "content": {"application/json": {}, "text/event-stream": {}}}}
    return ok | {status: {"model": ErrorResponse, "description": what} for status, what in _ERRORS.items()}


def _openapi(app: FastAPI, auth: bool) -> dict:
    """The schema with the errors this API really returns: 400 instead of FastAPI's 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for route, path in schema.get("paths", {}).items():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
                if auth and route.startswith("/v1/"):  # /health and /metrics stay open
                    op["security"] = [{"bearer": []}]
        comps = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.get("schemas", {}).pop(name, None)
        if auth:
            comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
    return app.openapi_schema


class _Run:
    """One request's generation, shaped as OpenAI JSON or SSE."""

    def __init__(self, backend, metrics: ServingMetrics, params: GenerateParams, stops: list[str], kind: str,
                 model: str, return_token_ids: bool = False, echo: str = "", index: int = 0):
        self.backend, self.metrics, self.params = backend, metrics, params
        self.index = index  # the choice's index (disagg.api.choices)
        self.prompt_done = asyncio.Event()  # set at the first chunk, or when the run ends (choices NOTE 1)
        self.stops, self.kind, self.model = stops, kind, model
        self.return_token_ids, self.echo = return_token_ids, echo
        self._sent_ids = 0
        self._sent_logprobs = 0  # entries of ``logprobs`` already in an event
        self._text_offset = len(echo)  # where the next reported token's text starts (completions' text_offset)
        self.created = int(time.time())
        self.ids: list[int] = []
        self.logprobs = [] if params.sampling.logprobs is not None else None  # one per id, when asked
        self.text = ""
        self.finish_reason: str | None = None
        self.last: StreamChunk | None = None

    async def _pieces(self) -> AsyncIterator[str]:
        """Yields new text; stops at a stop string; raises APIError on engine errors."""
        text = IncrementalText(self.backend.tokenizer)
        self.ids = text.ids
        longest_stop = max((len(s) for s in self.stops), default=0)
        sent = 0  # characters of self.text yielded so far
        t0 = time.perf_counter()
        t_prev = None
        agen = _guarded(self.backend.stream(self.params))
        try:
            async for chunk in agen:
                self.last = chunk
                self.prompt_done.set()
                if chunk.error:
                    self.metrics.request_done(self.kind, "error")
                    if chunk.finish_reason == "invalid":  # the engine refused the request: the client's fault
                        raise APIError(400, chunk.error)
                    if chunk.finish_reason == "error":
                        raise APIError(500, chunk.error, type="server_error")
                    raise APIError(503, chunk.error, type="server_error", headers={"Retry-After": "1"})
                new = ""
                if chunk.token_ids:
                    now = time.perf_counter()
                    if t_prev is None:
                        self.metrics.ttft.observe(now - t0)
                    else:
                        self.metrics.itl.observe((now - t_prev) / len(chunk.token_ids))
                    t_prev = now
                    if self.logprobs is not None:
                        self.logprobs.extend(chunk.logprobs or ())
                    new = text.push(chunk.token_ids)  # "" while a UTF-8 sequence is incomplete (detok NOTE 1)
                if chunk.finished:
                    new += text.flush()
                if new:
                    searched = max(0, len(self.text) - longest_stop + 1)  # earlier text held no stop string
                    self.text += new
                    cut = _find_stop(self.text, self.stops, searched)
                    if cut is not None:
                        self.text = self.text[:cut]
                        self.finish_reason = "stop"
                        if len(self.text) > sent:
                            yield self.text[sent:]
                        break
                # Text that may be the start of a stop string is held until the next piece shows
                # whether it is (a stop string never reaches the client, streamed or not).
                held = 0 if chunk.finished else _stop_prefix(self.text, self.stops, sent, longest_stop)
                ready = len(self.text) - held
                piece, sent = self.text[sent:ready], ready
                if chunk.token_ids or piece:
                    yield piece  # may be "" (a token whose text is held)
                if chunk.finished:
                    self.finish_reason = chunk.finish_reason
                    break
        finally:
            self.prompt_done.set()
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
            choice = {"index": self.index, **body, "finish_reason": finish}
        else:
            choice = {"index": self.index, "text": text, "logprobs": None, "finish_reason": finish}
        if self.logprobs is not None:
            choice["logprobs"] = self._logprobs_since(self._sent_logprobs if delta else 0)
        if self.return_token_ids:
            choice["token_ids"] = self.ids[self._sent_ids:] if delta else list(self.ids)
            self._sent_ids = len(self.ids)
        return choice

    def _logprobs_since(self, start: int) -> dict | None:
        """The logprobs of the tokens from ``start`` on, in this endpoint's shape."""
        end = min(len(self.ids), len(self.logprobs))
        ids, entries = self.ids[start:end], self.logprobs[start:end]
        self._sent_logprobs = end
        tok = self.backend.tokenizer
        if self.kind == "chat.completion":
            return chat_logprobs(tok, ids, entries)
        if start == 0:
            self._text_offset = len(self.echo)
        shaped = completion_logprobs(tok, ids, entries, self._text_offset)
        self._text_offset += sum(len(t) for t in shaped["tokens"])
        return shaped

    async def run(self) -> _Run:
        """Generate to the end (non-streamed)."""
        async for _ in self._pieces():
            pass
        return self

    async def events(self) -> AsyncIterator[dict]:
        """This choice's entries of ``choices`` in the SSE chunks, in order; raises APIError."""
        if self.kind == "chat.completion":
            yield {"index": self.index, "delta": {"role": "assistant"}, "finish_reason": None}
        if self.echo:
            yield {"index": self.index, "text": self.echo, "logprobs": None, "finish_reason": None}
        async with aclosing(self._pieces()) as pieces:
            async for piece in pieces:
                if piece or self.return_token_ids:
                    yield self._choice(piece, None, delta=True)
        yield self._choice("", self.finish_reason, delta=True)


class _Response:
    """A request's choices (``disagg.api.choices``), shaped as one OpenAI JSON body or SSE stream."""

    def __init__(self, runs: list[_Run], request_id: str, kind: str, model: str):
        self.runs, self.request_id, self.kind, self.model = runs, request_id, kind, model
        self.created = runs[0].created

    def _usage(self) -> dict:
        return summed_usage([r._usage() for r in self.runs])

    async def whole(self) -> dict:
        first, rest = self.runs[0], self.runs[1:]
        tasks = [asyncio.create_task(first.run())]
        try:
            if rest:
                await first.prompt_done.wait()  # choices NOTE 1
                tasks += [asyncio.create_task(r.run()) for r in rest]
            await asyncio.gather(*tasks)
        finally:  # an error or the client leaving stops every choice (choices NOTE 4)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        body = {"id": self.request_id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [r._choice(r.echo + r.text, r.finish_reason, delta=False) for r in self.runs],
                "usage": self._usage()}
        if first.last is not None:  # extension: where the request ran and where its prompt state came from
            body["disagg"] = {"replica": first.last.replica_id, "cached_source": first.last.cached_source}
            if rest:
                body["disagg"]["choices"] = [
                    {"replica": r.last.replica_id, "cached_source": r.last.cached_source,
                     "cached_tokens": r.last.num_cached_tokens} for r in self.runs if r.last is not None]
        return body

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        head = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}
        streams = [r.events() for r in self.runs]
        try:
            if len(streams) == 1:
                events = streams[0]
            else:
                events = merged(streams, self.runs[0].prompt_done)
            async with aclosing(events) as choices:
                async for choice in choices:
                    yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self._usage()})
        except APIError as exc:
            yield _sse({"error": exc.body()})
        yield b"data: [DONE]\n\n"


class _ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator when it ends, however it ends.

    When the client disconnects, Starlette cancels the task sending the body and leaves the
    generator suspended; its ``finally`` blocks (which abort the generation in the engine and
    free its state) would run only when the garbage collector finds it, and until then the engine
    would go on generating for nobody. Closing it here runs them at once.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def _guarded(chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
    """The backend's chunks; a backend failure becomes a 503 for the client (and a logged trace)."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError:
        raise
    except Exception as exc:
        log.exception("generation failed in the backend")
        raise APIError(503, f"generation failed: {type(exc).__name__}; retry the request", type="server_error",
                       code="backend_unavailable", headers={"Retry-After": "1"}) from exc
    finally:
        await chunks.aclose()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix(text: str, stops: list[str], start: int, longest: int) -> int:
    """The length of the longest end of ``text[start:]`` that begins some stop string (of at most
    ``longest`` characters)."""
    for k in range(min(len(text) - start, longest - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0
