"""User mistakes on the command line: error lines naming the fix, exit status 2, no traceback.

Every case runs ``python -m disagg.launch.cli`` as a subprocess, as a user would; none starts Ray
(the checks run before it: a message about a started Ray instance would fail the test).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "disagg.launch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str, max_lines: int = 2) -> list[str]:
    """Exit 2, no traceback, at most ``max_lines`` lines, each needle in the output."""
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Ray instance" not in proc.stderr
    assert 1 <= len(lines) <= max_lines, lines
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return lines


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "app.yaml"
    path.write_text(text)
    return str(path)


def test_missing_config_names_the_file():
    proc = run_cli("serve", "--config", "no/such/config.yaml")
    assert_user_error(proc, "error: config 'no/such/config.yaml' does not exist", "local-cpu.yaml")


def test_a_typo_in_a_config_key_gets_a_did_you_mean(tmp_path):
    proc = run_cli("serve", "--config", write(tmp_path, "model: {nmae: tiny}\nengine: {blok_size: 64}\n"))
    lines = assert_user_error(proc)
    assert "unknown key 'model.nmae'; did you mean 'model.name'?" in lines[0]
    assert "unknown key 'engine.blok_size'; did you mean 'engine.block_size'?" in lines[1]


def test_a_bad_value_names_the_key_and_the_rule(tmp_path):
    proc = run_cli("serve", "--config", write(tmp_path, "engine: {block_size: 100}\n"))
    assert_user_error(proc, "engine.block_size", "multiple of 64", "(got 100)", max_lines=1)


def test_a_serve_config_with_a_typo_is_checked_the_same_way(tmp_path):
    text = "applications:\n  - import_path: deployments.app:build_app\n    args: {deploymnet: {mode: aggregated}}\n"
    proc = run_cli("serve", "--config", write(tmp_path, text))
    assert_user_error(proc, "unknown key 'deploymnet'; did you mean 'deployment'?", max_lines=1)


def test_invalid_yaml_gives_the_line(tmp_path):
    proc = run_cli("serve", "--config", write(tmp_path, "model:\n  name: [tiny\n"))
    assert_user_error(proc, "is not valid YAML at line", max_lines=1)


@pytest.mark.parametrize("args", [("serve", "tinyy"), ("serve", "--model", "tinyy"),
                                  ("generate", "--model", "tinyy", "--prompt", "hi")])
def test_an_unknown_model_lists_the_presets(args):
    assert_user_error(run_cli(*args), "unknown model 'tinyy'", "did you mean 'tiny'?", max_lines=1)


def test_a_directory_without_config_json_is_no_checkpoint(tmp_path):
    assert_user_error(run_cli("serve", str(tmp_path)), "has no config.json", max_lines=1)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cuda_without_a_gpu_says_so(command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert_user_error(run_cli(command, "--device", "cuda", *extra), "torch sees no GPU", "--device cpu",
                      max_lines=1)


def test_a_port_in_use_is_found_before_ray_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("serve", "--port", str(port))
    assert_user_error(proc, f"port {port} on 127.0.0.1 is already in use", "--port", max_lines=1)


def test_debug_shows_the_traceback():
    proc = run_cli("--debug", "serve", "--config", "no/such/config.yaml")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "UsageError" in proc.stderr


def test_a_bad_flag_shows_the_subcommands_usage():
    proc = run_cli("serve", "--bogus")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: disagg serve ")
    assert "disagg serve: error: unrecognized arguments: --bogus" in proc.stderr


def test_version_and_defaults_in_help():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("disagg ")
    serve = run_cli("serve", "--help").stdout
    assert "MODEL" in serve and "(default: info)" in " ".join(serve.split())
    generate = run_cli("generate", "--help").stdout
    assert "(default: 32)" in " ".join(generate.split())


def test_generate_names_the_model_as_the_server_does():
    import json

    from disagg.config import AppConfig

    proc = run_cli("generate", "--token-ids", "5,6,7", "--max-tokens", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == AppConfig().model.openai_name == "disagg-tiny"


def test_more_cpus_than_the_local_cluster_has_fails_fast(tmp_path):
    config = write(tmp_path, "deployment: {decode: {num_cpus: 4096}}\n")
    assert_user_error(run_cli("serve", "--config", config), "the replicas reserve", "lower deployment.*.num_cpus",
                      max_lines=1)


def test_the_documented_local_config_fits_a_two_core_machine():
    """``serve run deployments/configs/local-cpu.yaml`` gives Ray one logical CPU per core."""
    from disagg.config import load_config
    from disagg.launch.preflight import check_cpus

    check_cpus(load_config(ROOT / "deployments" / "configs" / "local-cpu.yaml"), 2)
