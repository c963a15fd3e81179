"""Schemathesis fuzzing of the HTTP API from its own OpenAPI schema, over real HTTP.

The in-process backend serves (real engine, real tiers; no Ray). Generation covers schema-valid
and schema-invalid bodies. Every response must be: below 500; conforming to the documented
statuses, content types and error schema; a 4xx for invalid data; and, when it is an error, a
well-formed OpenAI error object (also inside an SSE stream). The default run is bounded (a few
dozen cases per operation); ``-m slow`` runs a longer one.
"""

from __future__ import annotations

import json

import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from disagg.api.app import create_app  # noqa: E402
from disagg.api.schemas import MAX_FIELD_CHARS  # noqa: E402
from disagg.config import load_config  # noqa: E402
from disagg.launch.inprocess import InProcessBackend  # noqa: E402
from tests.helpers import serve_asgi  # noqa: E402

MODEL = "disagg-tiny"
AUTH = {"Authorization": "Bearer fuzz-key"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_url():
    # a short context keeps every accepted request cheap: at most 96 tokens of prompt + output
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 32, "max_num_batched_tokens": 256, "max_model_len": 96,
                                  "num_threads": 1},
                       "transfer": {"host": {"capacity_mb": 32, "pin_memory": False}},
                       "deployment": {"mode": "disaggregated"}, "router": {"local_prefill_max_tokens": 32},
                       "http": {"api_keys": ["fuzz-key"], "max_body_bytes": 1 << 16, "openapi": True}})
    backend = InProcessBackend(cfg)
    with serve_asgi(create_app(backend, cfg.http)) as url:
        yield url
    backend.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(fuzz_url + "/openapi.json", headers=AUTH)  # behind the key


schema = schemathesis.pytest.from_fixture("api_schema")


def _check_openai_errors(response) -> None:
    """Errors are OpenAI error objects; SSE streams carry only JSON events, errors included, then [DONE]."""
    assert response.status_code < 500, response.text
    ctype = response.headers.get("content-type", [""])
    ctype = ctype[0] if isinstance(ctype, list) else ctype
    if response.status_code >= 400:
        err = json.loads(response.text)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], response.text
        assert isinstance(err["type"], str)
        return
    if ctype.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            obj = json.loads(event)
            if "error" in obj:
                assert set(obj["error"]) == ERROR_KEYS, event


def _target_served_model(case) -> None:
    """Most generated ``model`` strings name no model (404): aim string ones at the served model,
    except one too long for the schema (a negative case about the model field must stay negative).
    And keep accepted requests short: integer output limits are capped at 4 tokens (a CPU budget)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) <= MAX_FIELD_CHARS:
        body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 4:
            body[name] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4


def _run(case) -> None:
    _target_served_model(case)
    response = case.call(headers=AUTH, timeout=120)
    case.validate_response(response, checks=CHECKS, headers=AUTH)
    _check_openai_errors(response)


_FAST = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
_LONG = settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@schema.include(method="POST").parametrize()
@_FAST
def test_fuzz_generation_endpoints(case):
    _run(case)


@schema.include(method="GET").parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz_read_endpoints(case):
    _run(case)


@pytest.mark.slow
@schema.include(method="POST").parametrize()
@_LONG
def test_fuzz_generation_endpoints_long(case):
    _run(case)
