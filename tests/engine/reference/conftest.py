"""Shared fixtures for the reference model tests: the tiny preset, built once per dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from disagg.engine.reference.cache_view import DenseSequenceCache, SeqInput
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.model import K3ForCausalLM


@pytest.fixture(scope="session")
def tiny_config():
    return load_preset("tiny")


@pytest.fixture(scope="session")
def tiny_fp32(tiny_config):
    return K3ForCausalLM.random_init(tiny_config, seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_fp64(tiny_config):
    return K3ForCausalLM.random_init(tiny_config, seed=0, dtype=torch.float64)


def token_ids(n: int, seed: int = 1, vocab: int = 260) -> torch.Tensor:
    return torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, ids: torch.Tensor, cuts: list[int], cache=None) -> torch.Tensor:
    """Logits of every token when the sequence is fed in pieces ending at ``cuts``."""
    cache = cache or DenseSequenceCache.empty(model.config, model.dtype)
    outs, start = [], 0
    for end in [*cuts, ids.numel()]:
        if end > start:
            outs.append(model([SeqInput(ids[start:end], start, cache, all_logits=True)])[0])
            start = end
    return torch.cat(outs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="session")
def helpers():
    """The helper functions above, for test modules (conftest is not imported directly)."""
    return SimpleNamespace(token_ids=token_ids, run_chunks=run_chunks, rel_err=rel_err)
