"""OpenAI-compatible request and response bodies (the subset disagg serves).

Extensions beyond OpenAI's fields, all optional: ``ignore_eos``,
``session_id`` (routing affinity), ``cache_salt`` (tenant isolation of cached
state), ``stop_token_ids``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# Bodies are validated strictly: the JSON types the schema declares, no "true" -> True, no "7" -> 7.
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _whole_number(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v


JSONInt = Annotated[int, BeforeValidator(_whole_number)]  # a JSON integer: 7 or 7.0 (JSON Schema's view)


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

    model: str
    max_tokens: JSONInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    n: JSONInt | None = Field(default=1, ge=1, le=1)
    seed: JSONInt | None = Field(default=None, ge=0, le=2**62)
    stop: str | list[str] | None = None
    stop_token_ids: list[JSONInt] | None = Field(default=None, max_length=256)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    return_token_ids: bool | None = False  # add the generated token ids to each choice
    user: str | None = None
    session_id: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(default=None, max_length=256)

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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JSONInt | None = Field(default=None, ge=1)


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
