"""The bench's preflight and the prompt parameters it takes from the server.

The server is the real HTTP app over the tiny reference model in this process
(``tests.helpers``); the "no server" case runs the CLI as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.config import HTTPConfig
from disagg.launch.local import free_port
from disagg.tools.bench.preflight import (
    FALLBACK_VOCAB_SIZE,
    PreflightError,
    ServerInfo,
    probe,
    token_params,
)
from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE
from tests.helpers import serve_asgi, tiny_aggregated_backend

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def backend():
    with tiny_aggregated_backend() as b:
        yield b


@pytest.fixture(scope="module")
def server(backend):
    from disagg.api.app import create_app

    with serve_asgi(create_app(backend)) as url:
        yield url


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    from disagg.tools.bench.synth import synthesize
    from disagg.tools.bench.trace import save_trace

    path = tmp_path_factory.mktemp("trace") / "t.jsonl"
    records = synthesize(2, 0, block_size=64, scale=0.01, max_input=600)
    for r in records:
        r.output_length = min(r.output_length, 4)
    save_trace(records, path)
    return str(path)


def test_probe_reads_the_servers_vocabulary_block_size_and_limit(server, backend):
    info = probe(server)
    assert info == ServerInfo("disagg-tiny", ["disagg-tiny"], 512, 64, backend.max_model_len)
    assert backend.vocab_size == 512 and backend.block_size == 64


def test_a_model_the_server_does_not_serve_is_named_with_what_it_serves(server):
    with pytest.raises(
        PreflightError, match=r"model 'k3' is not served at .*; it serves: disagg-tiny"
    ):
        probe(server, model="k3")


def test_a_server_that_wants_a_key_says_how_to_give_one(backend):
    from disagg.api.app import create_app

    with serve_asgi(create_app(backend, HTTPConfig(api_keys=["sk-1"]))) as url:
        with pytest.raises(PreflightError, match="wants an API key: pass --api-key"):
            probe(url)
        assert probe(url, api_key="sk-1").vocab_size == 512


def test_no_server_fails_in_one_line_with_exit_2(trace):
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "disagg.launch.cli", "bench", "--url", url, "--trace", trace],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot reach {url} (connection refused); start a server first "
        "(disagg serve listens on http://127.0.0.1:8000) or fix --url"
    ]


@pytest.mark.parametrize(
    ("flags", "server", "want"),
    [
        ({}, ServerInfo("m", ["m"], 512, 64, 4096), (512, 100, 64, "server", "server")),
        (
            {"vocab_size": 1000, "block_size": 128},
            ServerInfo("m", ["m"], 512, 64, None),
            (1000, 100, 128, "flag", "flag"),
        ),
        (
            {},
            ServerInfo("m", ["m"], None, None, None),
            (FALLBACK_VOCAB_SIZE, 100, DEFAULT_BLOCK_SIZE, "fallback", "fallback"),
        ),
        ({}, None, (FALLBACK_VOCAB_SIZE, 100, DEFAULT_BLOCK_SIZE, "fallback", "fallback")),
        (
            {},
            ServerInfo("m", ["m"], 64, 64, None),
            (64, 0, 64, "server", "server"),
        ),  # ids start at 0 below 100
    ],
)
def test_each_parameter_is_the_flag_else_the_servers_else_the_fallback(flags, server, want):
    tp = token_params(server, **flags)
    assert (
        tp.vocab_size,
        tp.first_token_id,
        tp.block_size,
        tp.sources["vocab_size"],
        tp.sources["block_size"],
    ) == want


def test_a_first_token_id_outside_the_vocabulary_is_refused():
    with pytest.raises(
        PreflightError, match="--first-token-id 600 must be below the vocabulary size 512"
    ):
        token_params(ServerInfo("m", ["m"], 512, 64, None), first_token_id=600)


def bench(server: str, trace: str, out: Path, *extra: str) -> int:
    from disagg.tools.bench.cli import main

    return main(
        [
            "bench",
            "--url",
            server,
            "--trace",
            trace,
            "--out",
            str(out),
            "--requests",
            "3",
            "--think-scale",
            "0",
            "--no-plots",
            "--no-progress",
            *extra,
        ]
    )


def test_the_quick_start_fits_the_server(server, trace, tmp_path, capsys):
    """No vocabulary flag: the prompts are built for the tiny model's 512 ids and all succeed."""
    assert bench(server, trace, tmp_path) == 0
    out = capsys.readouterr()
    assert (
        "server: disagg-tiny at" in out.out
        and "vocab_size 512 (server), block_size 64 (server)" in out.out
    )
    assert "failed" not in out.err

    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "c1" / "requests.jsonl").read_text().splitlines()
    ]
    assert len([r for r in rows if not r.get("warmup")]) == 3
    assert all(r["error"] is None for r in rows)


def test_failed_requests_say_why_on_the_console(server, trace, tmp_path, capsys):
    """A vocabulary the server does not have: every request fails, and the console gives the reason."""
    assert bench(server, trace, tmp_path, "--vocab-size", "32000") == 1
    err = capsys.readouterr().err
    assert (
        "c1: 3 of 3 requests failed; first: http_4xx (HTTP 400): token ids must be in [0, 512)"
        in err
    )
