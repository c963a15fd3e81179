"""K3ForCausalLM: names, init, and the exactness contracts of forward()."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.reference.cache_view import DenseSequenceCache, SeqInput
from disagg.engine.reference.model import K3ForCausalLM
from disagg.engine.reference.weights import weights_fingerprint


def test_parameter_names_and_shapes(tiny_fp32):
    cfg = tiny_fp32.config
    p = dict(tiny_fp32.named_parameters())
    hk, h = cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_num_heads
    kda = "model.layers.0.self_attn."
    assert p[kda + "q_conv1d.weight"].shape == (hk, 1, cfg.conv_width)
    assert p[kda + "A_log"].shape == (1, 1, h, 1) and p[kda + "dt_bias"].shape == (hk,)
    assert p[kda + "f_a_proj.weight"].shape == (cfg.kda_head_dim, cfg.hidden_size)
    assert p[kda + "b_proj.weight"].shape == (h, cfg.hidden_size)
    assert p[kda + "o_norm.weight"].shape == (cfg.kda_head_dim,)
    for name in [
        "k_proj",
        "v_proj",
        "k_conv1d",
        "v_conv1d",
        "f_b_proj",
        "g_a_proj",
        "g_b_proj",
        "o_proj",
    ]:
        assert kda + name + ".weight" in p
    mla = "model.layers.3.self_attn."
    assert p[mla + "q_proj.weight"].shape == (cfg.num_attention_heads * 96, cfg.hidden_size)
    assert p[mla + "kv_a_proj_with_mqa.weight"].shape == (cfg.latent_dim, cfg.hidden_size)
    assert p[mla + "kv_a_layernorm.weight"].shape == (cfg.kv_lora_rank,)
    assert p[mla + "kv_b_proj.weight"].shape == (cfg.num_attention_heads * 128, cfg.kv_lora_rank)
    assert (
        "model.layers.0.mlp.gate_proj.weight" in p
        and "model.layers.0.block_sparse_moe.gate.weight" not in p
    )
    moe = "model.layers.1.block_sparse_moe."
    assert p[moe + "gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)
    assert p[moe + "gate.e_score_correction_bias"].shape == (cfg.num_experts,)
    assert p[moe + f"experts.{cfg.num_experts - 1}.w2.weight"].shape == (
        cfg.hidden_size,
        cfg.moe_intermediate_size,
    )
    assert moe + "shared_experts.up_proj.weight" in p
    for name in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.7.input_layernorm.weight",
        "model.layers.7.post_attention_layernorm.weight",
    ]:
        assert name in p
    assert 2_000_000 < tiny_fp32.num_parameters() < 20_000_000


def test_random_init_is_deterministic_and_peaked(tiny_config, tiny_fp32, tiny_fp64, helpers):
    again = K3ForCausalLM.random_init(tiny_config, seed=0)
    assert weights_fingerprint(again) == weights_fingerprint(tiny_fp32)
    assert weights_fingerprint(
        K3ForCausalLM.random_init(tiny_config, seed=1)
    ) != weights_fingerprint(tiny_fp32)
    assert torch.equal(
        tiny_fp64.lm_head.weight.float(), tiny_fp32.lm_head.weight
    )  # same draws in any dtype
    logits = helpers.run_chunks(tiny_fp32, helpers.token_ids(120), [])
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5
    layer = tiny_fp32.model.layers[0]
    x = layer.input_layernorm(tiny_fp32.model.embed_tokens(helpers.token_ids(120)))
    alpha = layer.self_attn.decay(x).exp()
    assert ((alpha > 0.9) & (alpha < 0.999)).float().mean() > 0.7


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_incremental_decode_equals_full_forward(dtype, tol, tiny_fp32, tiny_fp64, helpers):
    model = tiny_fp64 if dtype == torch.float64 else tiny_fp32
    ids = helpers.token_ids(100, seed=2)
    full = helpers.run_chunks(model, ids, [])
    assert full.dtype == dtype and full.shape == (100, model.config.vocab_size)
    cache = DenseSequenceCache.empty(model.config, dtype)
    steps = [model([SeqInput(ids[:80], 0, cache)])[0]]
    for i in range(80, 100):
        steps.append(model([SeqInput(ids[i : i + 1], i, cache)])[0])
    inc = torch.cat(steps)
    assert helpers.rel_err(inc, full[79:]) < tol
    assert torch.equal(inc.argmax(-1), full[79:].argmax(-1))
    assert cache.num_tokens == 100


@pytest.mark.parametrize("cuts", [[128], [64, 128], [100], [1, 70]])
def test_split_prefill_equals_unsplit(cuts, tiny_fp32, tiny_fp64, helpers):
    ids = helpers.token_ids(200, seed=3)
    for model, tol in ((tiny_fp64, 1e-12), (tiny_fp32, 1e-5)):
        whole = helpers.run_chunks(model, ids, [])
        split = helpers.run_chunks(model, ids, cuts)
        assert helpers.rel_err(split, whole) < tol
        assert torch.equal(split.argmax(-1), whole.argmax(-1))


def test_block_aligned_split_leaves_identical_state(tiny_fp64, helpers):
    ids = helpers.token_ids(200, seed=4)
    a = DenseSequenceCache.empty(tiny_fp64.config, torch.float64)
    b = DenseSequenceCache.empty(tiny_fp64.config, torch.float64)
    helpers.run_chunks(tiny_fp64, ids, [], cache=a)
    helpers.run_chunks(tiny_fp64, ids, [128], cache=b)
    for x, y in zip(a.kda_rec + a.kda_conv + a.mla, b.kda_rec + b.kda_conv + b.mla, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_batched_sequences_match_running_alone(tiny_fp32, helpers):
    cfg = tiny_fp32.config
    long_ids, short_ids = helpers.token_ids(150, seed=5), helpers.token_ids(23, seed=6)
    alone_long = helpers.run_chunks(tiny_fp32, long_ids, [])
    alone_short = helpers.run_chunks(tiny_fp32, short_ids, [])
    # one forward: sequence A prefills its tail, sequence B prefills from scratch
    ca = DenseSequenceCache.empty(cfg)
    tiny_fp32([SeqInput(long_ids[:64], 0, ca)])
    cb = DenseSequenceCache.empty(cfg)
    out_a, out_b = tiny_fp32(
        [SeqInput(long_ids[64:], 64, ca, all_logits=True), SeqInput(short_ids, 0, cb)]
    )
    assert out_b.shape == (1, cfg.vocab_size)
    assert helpers.rel_err(out_a, alone_long[64:]) < 1e-5
    assert helpers.rel_err(out_b, alone_short[-1:]) < 1e-5
    assert torch.equal(out_a.argmax(-1), alone_long[64:].argmax(-1))
    assert torch.equal(out_b.argmax(-1), alone_short[-1:].argmax(-1))

    # greedy decode of both together equals each alone
    def greedy(seqs_ids, steps=6):
        caches = [DenseSequenceCache.empty(cfg) for _ in seqs_ids]
        toks = [
            [int(row.argmax())]
            for row in tiny_fp32([SeqInput(i, 0, c) for i, c in zip(seqs_ids, caches, strict=True)])
        ]
        for _ in range(steps):
            logits = tiny_fp32(
                [
                    SeqInput(torch.tensor([t[-1]]), c.num_tokens, c)
                    for t, c in zip(toks, caches, strict=True)
                ]
            )
            for t, row in zip(toks, logits, strict=True):
                t.append(int(row.argmax()))
        return toks

    together = greedy([long_ids, short_ids])
    assert together == greedy([long_ids]) + greedy([short_ids])


def test_state_layout_matches_dense_cache(tiny_fp32):
    cfg = tiny_fp32.config
    layout = tiny_fp32.state_layout("tiny", 64, torch.float32)
    cache = DenseSequenceCache.empty(cfg, torch.float32)
    assert layout.num_mla_layers == len(cache.mla) and layout.num_kda_layers == len(cache.kda_rec)
    assert layout.latent_dim == cache.mla[0].shape[1]
    assert cache.kda_conv[0].shape == (layout.conv_width - 1, 3 * layout.kda_heads * layout.head_k)
    assert cache.kda_rec[0].shape == (layout.kda_heads, layout.head_k, layout.head_v)
    assert (layout.cache_dtype, layout.state_dtype) == ("float32", "float32")
    assert tiny_fp32.state_layout("m", 64, torch.bfloat16).state_dtype == "float32"
    assert tiny_fp32.state_layout("m", 64, torch.float64).state_dtype == "float64"


def test_bf16_model_runs_with_fp32_logits_and_gate_params(tiny_config, helpers):
    model = K3ForCausalLM.random_init(tiny_config, seed=0, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32
    cache = DenseSequenceCache.empty(tiny_config, torch.bfloat16)
    out = model([SeqInput(helpers.token_ids(70), 0, cache)])[0]
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert cache.kda_rec[0].dtype == torch.float32 and cache.mla[0].dtype == torch.bfloat16
