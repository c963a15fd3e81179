"""Admission at the HTTP edge: API keys, per-key limits, bounded queueing with load shedding.

    request (/v1/*, and /openapi.json where served)
      -> Content-Length over max_body_bytes ...................... 413
      -> more than one Authorization header ...................... 400
      -> API key (constant-time, see KeyTable) ................... 401
      -> body read, at most max_body_bytes + 1 bytes ............. 413
         within body_timeout_s of the request's arrival .......... 408 (connection closed)
      generation endpoints only:
      -> the key's token bucket (rate_limit_per_key) ............. 429 + Retry-After
      -> the key's requests in flight (max_concurrent_per_key) ... 429 + Retry-After
      -> AdmissionGate: a running slot per choice (n), or a bounded wait ... 503 + Retry-After
      -> the app; the slot and the key's count are released once the response has been
         sent, streamed or not, whether it finished, failed or the client went away.

``EdgeMiddleware`` is a plain ASGI middleware around the FastAPI app so that it sees the whole
life of a streamed response. With no API keys configured every client shares one key.

Config example (the ``http:`` section)::

    http: {api_keys: [...], max_concurrent_per_key: 8, rate_limit_per_key: 5, rate_burst_per_key: 10,
           max_inflight: 256, max_queued: 512, queue_timeout_s: 30}

NOTES
1. Memory is bounded: at most ``max_inflight`` generations run and ``max_queued`` wait; a body is
   buffered only after the key checked out and never beyond ``max_body_bytes`` + 1 bytes, chunked
   or not. Per-key state exists only for configured keys (plus the shared anonymous key).
2. Key checks take the same time whichever key matched and whatever the keys' lengths: the
   presented token and every key are compared as HMAC-SHA256 digests, all of them, with
   ``hmac.compare_digest``.
3. A refused request holds nothing afterwards: no running slot, no in-flight count. (One refused
   for concurrency has spent a rate token: it was a request all the same.)
4. A client that disconnects before its body arrived, or while queued at the gate, is let go:
   nothing partial is served, and its queue place and in-flight count go back at once (counted
   as the rejection ``client_gone``). Checks apply to the route path, without the mount's
   ``root_path``.
5. A slow body holds a connection and, under Serve, one of the ingress's ongoing requests: the
   whole body must arrive within ``body_timeout_s`` of the request reaching the app (however
   it trickles in), or the request is answered 408 and its connection closed. Headers are the
   HTTP server's to bound (the front's ``timeout http-request``, ``deployments.haproxy_front``).
6. Credentials are unambiguous: a request with two ``Authorization`` headers is refused (400),
   whichever of them would match, instead of one silently winning.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from disagg.api.errors import APIError

ANONYMOUS = "anonymous"  # the shared key when no API keys are configured
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
SESSIONS_PATH = "/v1/sessions/"  # DELETE ends a session (disagg.flow NOTE 14): rate and concurrency limited
PROTECTED_PATHS = ("/openapi.json",)  # outside /v1/ but behind the key all the same
_SALT_CONTEXT = b"disagg-cache-salt"


def tenant_salt(api_key: str) -> str:
    """The cache salt of an API key's tenant: stable across replicas and restarts, not the key."""
    return hmac.new(_SALT_CONTEXT, api_key.encode(), hashlib.sha256).hexdigest()[:32]


def request_salt(tenant: str, explicit: str | None) -> str:
    """The salt a request's state keys carry: the tenant's, narrowed by an explicit ``cache_salt``.

    An explicit salt only partitions within its tenant: two keys sending the same ``cache_salt``
    still never share state.
    """
    if not tenant:
        return explicit or ""
    if not explicit:
        return tenant
    return hmac.new(tenant.encode(), explicit.encode(), hashlib.sha256).hexdigest()[:32]


class KeyTable:
    """The configured API keys; ``identify`` maps an Authorization header to a key id (NOTE 2)."""

    def __init__(self, keys: list[str]):
        if any(not k for k in keys):
            raise ValueError("an API key must not be empty")
        self._secret = os.urandom(32)  # per process: digests are never stored or sent
        self._digests = [self._digest(k.encode()) for k in keys]
        self._keys = list(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def _digest(self, token: bytes) -> bytes:
        return hmac.new(self._secret, token, hashlib.sha256).digest()

    def identify(self, authorization: str) -> str | None:
        """The matching key, or None. Same work whichever key (or none) matches."""
        scheme, _, token = authorization.partition(" ")
        presented = self._digest(token.strip().encode() if scheme.lower() == "bearer" else b"")
        match = None
        for key, digest in zip(self._keys, self._digests, strict=True):
            if hmac.compare_digest(presented, digest):
                match = key
        return match


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked."""

    rate: float
    burst: float
    tokens: float = -1.0  # current tokens (starts full)
    stamp: float = 0.0  # time of the last refill

    def take(self, now: float) -> float:
        """Take a token; returns 0.0, or the seconds until one is available (nothing taken)."""
        if self.tokens < 0:
            self.tokens, self.stamp = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(slots=True)
class _KeyState:
    bucket: TokenBucket | None  # None: no rate limit
    num_inflight: int = 0  # admitted generations of this key not yet finished


@dataclass(slots=True)
class KeyLimiter:
    """Per-key rate (token bucket) and concurrency limits. 0 disables a limit."""

    rate: float = 0.0
    burst: int = 0
    max_concurrent: int = 0
    _keys: dict[str, _KeyState] = field(default_factory=dict)

    def _state(self, key: str) -> _KeyState:
        st = self._keys.get(key)
        if st is None:
            bucket = TokenBucket(self.rate, float(self.burst or max(1, math.ceil(self.rate)))) if self.rate else None
            st = self._keys[key] = _KeyState(bucket)
        return st

    def admit(self, key: str, now: float) -> APIError | None:
        """Count one request of ``key`` in, or say why not (429 with Retry-After)."""
        st = self._state(key)
        if st.bucket is not None:
            wait = st.bucket.take(now)
            if wait > 0:
                return APIError(429, f"rate limit of {self.rate:g} requests/s for this API key exceeded",
                                code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
        if self.max_concurrent and st.num_inflight >= self.max_concurrent:
            return APIError(429, f"at most {self.max_concurrent} concurrent requests per API key",
                            code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        st.num_inflight += 1
        return None

    def done(self, key: str) -> None:
        st = self._keys[key]
        assert st.num_inflight > 0, "released a request that was not admitted"
        st.num_inflight -= 1


class AdmissionGate:
    """At most ``max_inflight`` running slots; up to ``max_queued`` slots' worth of requests wait in
    FIFO order, each at most ``timeout_s``; the rest are shed. A request takes one slot per
    generation it runs (its ``n`` choices: ``weight``). One event loop only (the HTTP app's).

    NOTES
    1. Released slots go straight to the waiters, oldest first (``num_running`` stays when one
       takes them), so a waiter is never overtaken by a newcomer; nor by a lighter waiter behind
       it: the oldest waits until its whole weight is free.
    2. A waiter that gives up (timeout, cancellation) leaves the queue; one that was handed its
       slots as it gave up keeps them (timeout) or passes them on (cancellation).
    3. A weight above ``max_inflight`` counts as ``max_inflight`` (the request runs alone), so
       every request can be admitted.
    """

    def __init__(self, max_inflight: int, max_queued: int, timeout_s: float):
        if max_inflight < 1 or max_queued < 0 or timeout_s <= 0:
            raise ValueError("need max_inflight >= 1, max_queued >= 0, timeout_s > 0")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.num_running = 0  # slots held
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()  # (handed its slots?, weight)
        self.num_shed = 0  # refused: queue full
        self.num_timed_out = 0  # refused: waited too long

    @property
    def num_queued(self) -> int:
        """Slots' worth of requests waiting."""
        return sum(w for f, w in self._waiters if not f.done())

    def _weight(self, weight: int) -> int:
        assert weight >= 1, "a request runs at least one generation"
        return min(weight, self.max_inflight)  # NOTE 3

    def try_acquire(self, weight: int = 1) -> bool:
        """Take ``weight`` free running slots now if there are (no one waits for them)."""
        weight = self._weight(weight)
        if self.num_running + weight <= self.max_inflight and not self._waiters:
            self.num_running += weight
            return True
        return False

    async def acquire(self, weight: int = 1) -> bool:
        """Take ``weight`` running slots (True), or be shed (False)."""
        if self.try_acquire(weight):
            return True
        weight = self._weight(weight)
        if self.num_queued + weight > self.max_queued:
            self.num_shed += 1
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, weight))
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            return True
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():
                return True  # handed its slots just as the wait ended
            self._forget(fut)
            self.num_timed_out += 1
            return False
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(weight)
            else:
                self._forget(fut)
            raise

    def _forget(self, fut: asyncio.Future) -> None:
        fut.cancel()
        self._waiters = deque(w for w in self._waiters if w[0] is not fut)
        self._hand_over()  # a heavy waiter leaving may let lighter ones behind it in

    def release(self, weight: int = 1) -> None:
        weight = self._weight(weight)
        assert self.num_running >= weight, "released more slots than taken"
        self.num_running -= weight
        self._hand_over()

    def _hand_over(self) -> None:
        """Free slots to the waiters, oldest first, while the oldest's weight fits (NOTE 1)."""
        while self._waiters:
            fut, weight = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if self.num_running + weight > self.max_inflight:
                return
            self._waiters.popleft()
            self.num_running += weight
            fut.set_result(True)


class EdgeMiddleware:
    """ASGI middleware applying the checks in the module docstring to ``/v1/*`` requests.

    It records the caller's key in ``scope["state"]["api_key"]`` (None without auth) for the app.
    """

    def __init__(self, app, max_body_bytes: int, keys: KeyTable, limiter: KeyLimiter, gate: AdmissionGate,
                 on_reject=None, body_timeout_s: float = 30.0, max_n: int = 1):
        self.app = app
        self.max_n = max_n  # choices served per request (http.max_n): the gate's largest weight
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.keys = keys
        self.limiter = limiter
        self.gate = gate
        self.on_reject = on_reject or (lambda reason: None)  # metrics hook: reason -> None

    async def __call__(self, scope, receive, send):
        path = _route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] != "http" or not (path.startswith("/v1/") or path in PROTECTED_PATHS):
            await self.app(scope, receive, send)
            return
        raw = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        headers = dict(raw)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._refuse(scope, receive, send, self._too_large(), "body_too_large")
            return
        if sum(k == "authorization" for k, _ in raw) > 1:  # NOTE 6
            err = APIError(400, "more than one Authorization header; send exactly one",
                           type="invalid_request_error", code="duplicate_credentials")
            await self._refuse(scope, receive, send, err, "duplicate_credentials")
            return
        api_key = None
        if self.keys:
            api_key = self.keys.identify(headers.get("authorization", ""))
            if api_key is None:
                err = APIError(401, "missing or invalid API key", type="authentication_error",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await self._refuse(scope, receive, send, err, "unauthorized")
                return
        scope.setdefault("state", {})["api_key"] = api_key
        wire = receive  # after the body, its next message can only be a disconnect
        body = b""
        if scope["method"] == "POST":
            try:
                body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
            except asyncio.TimeoutError:  # NOTE 5
                err = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout", headers={"Connection": "close"})
                await self._refuse(scope, receive, send, err, "body_timeout")
                return
            if body is _GONE:  # the client left before its body arrived: nothing to serve
                self.on_reject("client_gone")
                return
            if body is None:
                await self._refuse(scope, receive, send, self._too_large(), "body_too_large")
                return
            receive = _replay(body, receive)
        generation = scope["method"] == "POST" and path in GENERATION_PATHS
        if not (generation or (scope["method"] == "DELETE" and path.startswith(SESSIONS_PATH))):
            await self.app(scope, receive, send)
            return
        key = api_key or ANONYMOUS
        err = self.limiter.admit(key, time.monotonic())
        if err is not None:
            await self._refuse(scope, receive, send, err, err.code or "rate_limited")
            return
        try:
            if not generation:  # a session's end: the key's limits, not the admission gate (no engine slot)
                await self.app(scope, receive, send)
                return
            weight = num_choices(body, self.max_n)  # each choice is a generation (AdmissionGate)
            admitted = self.gate.try_acquire(weight) or await unless_disconnected(self.gate.acquire(weight), wire)
            if admitted is None:  # left while queued (NOTE 4): its place and key count go back
                self.on_reject("client_gone")
                return
            if not admitted:
                err = APIError(503, "the server is overloaded; retry shortly", type="server_error",
                               code="overloaded", headers={"Retry-After": "1"})
                await self._refuse(scope, receive, send, err, "overloaded")
                return
            try:
                await self.app(scope, receive, send)
            finally:
                self.gate.release(weight)
        finally:
            self.limiter.done(key)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")

    async def _read_body(self, receive):
        """The whole body; None once it passes ``max_body_bytes`` (NOTE 1); ``_GONE`` when the
        client disconnects first (a partial body is never served)."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _GONE
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)

    async def _refuse(self, scope, receive, send, err: APIError, reason: str) -> None:
        self.on_reject(reason)
        body = json.dumps({"error": err.body()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


_GONE = object()  # _read_body: the client disconnected


def num_choices(body: bytes, max_n: int) -> int:
    """The ``n`` a generation body asks for, when it is one the app will serve (an integer in
    [1, max_n]); else 1 (the app refuses the request before generating anything)."""
    if b'"n"' not in body:
        return 1
    try:
        n = json.loads(body).get("n")
    except (ValueError, AttributeError):
        return 1
    if type(n) is float and n.is_integer():  # 7.0 is an integer (the schema's JSONInt)
        n = int(n)
    return n if type(n) is int and 1 <= n <= max_n else 1


def _route_path(scope) -> str:
    """The path the app routes on: without the mount's ``root_path`` (uvicorn ``--root-path``, a
    Serve ``route_prefix``), so the checks apply however the app is mounted."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def unless_disconnected(work, receive):
    """``await work`` unless ``receive`` reports a disconnect first (the request's body already
    read, its next message can only be one); then cancel ``work`` and return None. A cancelled
    gate wait passes a slot handed over meanwhile on (AdmissionGate NOTE 2); a cancelled
    generation closes the backend's stream, which aborts it."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a server that cannot say: never give up on a guess
            await asyncio.Event().wait()

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left (or the caller was cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch
    return None if task.cancelled() else task.result()


def _replay(body: bytes, receive):
    """A ``receive`` that hands the buffered body once, then defers to the real one (disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
