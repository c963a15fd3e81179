"""OpenAI-compatible request and response bodies.

Every OpenAI parameter is either served or refused with a 400 naming it
(``UNSERVED``: a parameter is refused only when it asks for something other than
its no-op value, so clients that send the defaults keep working). Served:
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options``, ``logprobs`` (completions: the number of alternatives, 0-5;
chat: a flag with ``top_logprobs`` 0-20), ``echo``, ``user``, ``n`` up to
``http.max_n`` (``disagg.api.choices``) and ``best_of`` equal to 1 or ``n``
(checked in ``disagg.api.app``). Refused: ``best_of`` > ``n``, ``logit_bias``, non-zero
``presence_penalty``/``frequency_penalty``, ``suffix``, ``response_format``
other than text (nothing enforces a JSON grammar), ``tools``/``functions`` and
their choices, ``audio``, ``modalities`` other than text, ``prediction``,
``reasoning_effort``, ``web_search_options``.

Free-text fields that are not the prompt are short (``MAX_FIELD_CHARS``); the
prompt and messages are bounded by the body size and the context length.

Extensions beyond OpenAI's fields, all optional: ``ignore_eos``,
``session_id`` (routing affinity), ``session_end`` (this turn is the session's
last: once answered, its state is evicted first; needs ``session_id`` or
``user``), ``cache_salt`` (tenant isolation of cached state), ``stop_token_ids``,
``return_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# Bodies are validated strictly: the JSON types the schema declares, no "true" -> True, no "7" -> 7.
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _whole_number(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


JSONInt = Annotated[int, BeforeValidator(_whole_number)]  # a JSON integer: 7 or 7.0 (JSON Schema's view)
MAX_FIELD_CHARS = 256  # model, user, session_id, cache_salt, each stop string
MAX_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
ShortText = Annotated[str, Field(max_length=MAX_FIELD_CHARS)]


def _drop_nulls(data):
    """OpenAI's optional parameters are nullable, and clients send ``null`` for "unset": a null
    field takes its default (the schema says ``X | None``; the value is never None)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    model_config = _STRICT

    _nulls_are_defaults = model_validator(mode="before")(_drop_nulls)

    include_usage: bool | None = False


class _Common(BaseModel):
    model_config = _STRICT

    model: ShortText
    max_tokens: JSONInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    n: JSONInt | None = Field(default=1, ge=1, le=128)  # choices; at most http.max_n (disagg.api.choices)
    seed: JSONInt | None = Field(default=None, ge=0, le=2**62)
    stop: ShortText | list[ShortText] | None = None
    stop_token_ids: list[JSONInt] | None = Field(default=None, max_length=256)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    return_token_ids: bool | None = False  # add the generated token ids to each choice
    user: ShortText | None = None
    session_id: ShortText | None = None
    session_end: bool | None = False  # the session's last turn (disagg.flow NOTE 13)
    cache_salt: ShortText | None = None
    # OpenAI parameters refused unless at their no-op value (UNSERVED)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    _nulls_are_defaults = model_validator(mode="before")(_drop_nulls)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v


class CompletionRequest(_Common):
    prompt: str | list[JSONInt] | list[str]
    max_tokens: JSONInt | None = Field(default=16, ge=1)
    echo: bool | None = False  # the prompt's text before the completion's (token_ids stay the completion's)
    logprobs: JSONInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token; 0 = the token's own
    best_of: JSONInt | None = Field(default=1, ge=1, le=128)  # only 1 or n is served (disagg.api.app)
    suffix: str | None = None  # refused (UNSERVED)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
            elif any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                raise ValueError("a token-ID prompt must be a list of integers")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JSONInt | None = Field(default=None, ge=1)
    logprobs: bool | None = False  # the sampled tokens' log probabilities
    top_logprobs: JSONInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives (needs logprobs)
    response_format: ResponseFormat | None = None  # only {"type": "text"} is served (UNSERVED)
    # refused when present (UNSERVED)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None


def _refused_if_set(value) -> bool:
    return value is not None


# parameter -> "is this value one we do not serve?" (checked in this order; the first hit is the 400)
UNSERVED: dict[str, Any] = {
    "suffix": lambda v: bool(v),
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "response_format": lambda v: v is not None and v.type != "text",
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "parallel_tool_calls": _refused_if_set,
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "audio": _refused_if_set,
    "modalities": lambda v: v is not None and list(v) != ["text"],
    "prediction": _refused_if_set,
    "reasoning_effort": _refused_if_set,
    "web_search_options": _refused_if_set,
}
UNSERVED_WHY = {
    "best_of": "only best_of equal to 1 or n is served: choosing the n best of more samples by their "
               "cumulative log probability costs best_of generations for n answers, and vLLM's engine "
               "dropped it too (ask for n choices with their logprobs and rank them yourself)",
    "response_format": "only {\"type\": \"text\"} is served: nothing enforces a JSON grammar",
}


def unserved(body: BaseModel) -> str | None:
    """The first parameter of ``body`` asking for something not served, or None."""
    for name, refused in UNSERVED.items():
        if name in type(body).model_fields and refused(getattr(body, name)):
            return name
    return None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
