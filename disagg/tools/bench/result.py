"""One request's measurements in a benchmark replay (``RequestResult``) and its error classes.

Filled by the client (``disagg.tools.bench.client``) and the SSE parser (``disagg.tools.bench.sse``),
read by the metrics and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ERROR_CLASSES = ("connect", "timeout", "http_4xx", "http_5xx", "stream_broken", "other")


@dataclass(slots=True)
class RequestResult:
    """Measurements of one request (times: ``perf_counter_ns``)."""

    request_id: str  # sent as the x-request-id header
    send_ns: int  # the request started (connection taken, then written)
    first_token_ns: int | None = None  # first token chunk arrived
    end_ns: int | None = None  # stream finished (or failed)
    chunk_ns: list[int] = field(default_factory=list)  # arrival of every token chunk
    output_tokens: int = 0  # usage.completion_tokens, else token chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # one of ERROR_CLASSES, None on success
    error_detail: str = ""  # short message for the error
    # Context filled in by the runner:
    session_id: str = ""  # trace session
    turn: int = 0  # trace turn
    lane: int = -1  # closed-loop lane (-1: open loop)
    salt: int = 0  # cache-busting salt of this replay
    input_length: int = 0  # trace prompt length
    expected_output: int = 0  # trace output length (max_tokens)
    warmup: bool = False  # excluded from metrics
    send_kernel_ns: int | None = None  # kernel transmit time of the request (raw, send_stamps)

    def __repr__(self) -> str:
        return (
            f"RequestResult({self.request_id!r}, ok={self.ok}, ttft_ms={self.ttft_ms}, "
            f"output_tokens={self.output_tokens}, error={self.error!r})"
        )

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.send_ns) / 1e6

    @property
    def e2e_ms(self) -> float | None:
        if self.end_ns is None:
            return None
        return (self.end_ns - self.send_ns) / 1e6

    @property
    def itl_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None below two tokens."""
        if (
            not self.ok
            or self.output_tokens < 2
            or self.first_token_ns is None
            or self.end_ns is None
        ):
            return None
        return (self.end_ns - self.first_token_ns) / 1e6 / (self.output_tokens - 1)
