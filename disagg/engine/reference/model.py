"""``K3ForCausalLM``: the reference Kimi Linear / K3 decoder (KDA + MLA + MoE).

Pre-norm residual blocks, HF parameter names:

    h = embed_tokens(ids)
    for layer i:   h = h + self_attn_i(input_layernorm(h))        KDA or MLA
                   h = h + ffn_i(post_attention_layernorm(h))     mlp (dense) or block_sparse_moe
    logits = lm_head(norm(h))

One ``forward`` serves a batch of sequences, each with its own new tokens,
``start_pos`` and cache. Token-wise work (embedding, norms, projections, MoE)
runs once over all new tokens concatenated; only sequence mixing (short conv,
KDA recurrence, MLA attention) loops over sequences:

    rows    | seq 0: n0 new tokens | seq 1: n1 new tokens | ...
    mixing  | cache 0, start_pos 0 | cache 1, start_pos 1 | ...

NOTES
1. The model is stateless: every piece of per-sequence state lives in the
   ``SequenceCache`` it is handed (MLA rows per MLA layer, KDA conv and
   recurrent state per KDA layer; layer indices count within each kind).
2. ``A_log``, ``dt_bias`` and ``e_score_correction_bias`` stay fp32 when the
   model runs in a half dtype (``cast_model``).
3. ``random_init`` draws every parameter from one CPU generator in fp32, in
   sorted-name order: the same seed gives the same weights in any dtype.
4. Exactness: chunk boundaries of KDA are absolute (multiples of 64), so a
   prefill split there repeats the KDA arithmetic bit for bit. Dense matmuls
   over different row counts (MoE expert batches, 1-row decode) may round
   differently in BLAS, so split and unsplit runs agree to ~1e-7 relative in
   fp32 (tight in fp64), not bitwise; greedy tokens agree thanks to the peaked init.
5. Single-token steps over the engine's paged cache mix as one batch
   (``DecodeBatch``: one gather of the paged latents per MLA layer, one slot
   gather/scatter per KDA layer) instead of one sequence at a time; the
   arithmetic is the same, reduced over padded lengths (rounding as in NOTE 4).
6. Each layer runs in three parts: ``pre`` (input norm, the attention's
   projections) and ``post`` (output projection, residual, feed-forward) are
   token-wise, ``mix`` is the sequence mixing over each sequence's state. A
   step of a few hundred tokens launches ~1,500 kernels, most of them in the
   token-wise parts, and on a GPU the host takes several times longer to
   launch them than the device to run them. So on CUDA (``graphs=True``) a
   step of up to ``MAX_GRAPH_TOKENS`` tokens, padded to a bucket, replays the
   token-wise parts as CUDA graphs (``graphs.StepGraphs``: post of layer i and
   pre of layer i+1 are one graph) and runs only the mixing eagerly between
   them. Token-wise work is row by row, so pad rows never reach real ones; the
   padded matmuls may round differently (as in NOTE 4).
7. The mixing of a decode batch (NOTE 5) is shaped by tensors, so a step
   made only of one cache's single-token sequences (a decode worker's steady
   state) replays as a single graph, mixing included (graphs NOTE 6): the
   host launches one graph instead of the mixing's ~460 kernels between the
   token-wise graphs. Its keys pad to a power of two blocks (masked, as the
   batch's own padding), so it rounds as NOTE 5 does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from disagg.engine.reference.cache_view import SeqInput
from disagg.engine.reference.config import K3Config
from disagg.engine.reference.kda import KimiDeltaAttention
from disagg.engine.reference.layers import RMSNorm, TokenSpan, state_dtype
from disagg.engine.reference.mla import KimiMLAAttention
from disagg.engine.reference.moe import DENSE_MAX_TOKENS_CUDA, SparseMoE, SwiGLU
from disagg.engine.reference.paged_cache import DecodeBatch
from kv_transfer.objects import StateLayout

FP32_PARAMS = ("A_log", "dt_bias", "e_score_correction_bias")  # NOTE 2
MAX_GRAPH_TOKENS = DENSE_MAX_TOKENS_CUDA  # NOTE 6: the largest step replayed from graphs (MoE's dense path)
LOGIT_STD = 6.0  # random init: logits std, so greedy choices have wide margins


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_id: int):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.is_kda = c.is_kda_layer(layer_id)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(
                c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.conv_width, c.rms_norm_eps
            )
        else:
            self.self_attn = KimiMLAAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.is_moe_layer(layer_id):
            self.block_sparse_moe = SparseMoE(c)
        else:
            self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    # NOTE 6: ``pre`` and ``post`` are token-wise, ``mix`` is the sequence mixing.
    def pre(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Input norm and the attention's token-wise projections."""
        return self.self_attn.pre(self.input_layernorm(h))

    def mix(self, pre, spans: list[TokenSpan], kind_idx: int, absorbed: bool | None,
            decode: DecodeBatch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_kda:
            return self.self_attn.mix(pre, spans, kind_idx, decode, out)
        return self.self_attn.mix(pre, spans, kind_idx, absorbed, decode, out)

    def post(self, h: torch.Tensor, pre, mixed: torch.Tensor) -> torch.Tensor:
        """The attention's output projection, the residual, and the feed-forward block."""
        if self.is_kda:
            h = h + self.self_attn.post(mixed, pre[3], h.dtype)
        else:
            h = h + self.self_attn.post(mixed, h.dtype)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return h + ffn(self.post_attention_layernorm(h))

    def forward(
        self,
        h: torch.Tensor,
        spans: list[TokenSpan],
        kind_idx: int,
        absorbed: bool | None,
        decode: DecodeBatch | None = None,
    ) -> torch.Tensor:
        pre = self.pre(h)
        return self.post(h, pre, self.mix(pre, spans, kind_idx, absorbed, decode))


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class K3ForCausalLM(nn.Module):
    """Reference model. ``forward(seqs) -> per-sequence logits``; see the module docstring."""

    def __init__(self, config: K3Config):
        super().__init__()
        la = config.linear_attn_config
        if la.get("use_full_rank_gate") or "gate_lower_bound" in la:
            raise ValueError(
                "linear_attn_config.use_full_rank_gate / gate_lower_bound (K3 KDA gate) is not supported"
            )
        if config.extra.get("mla_use_output_gate"):
            raise ValueError(
                "mla_use_output_gate: gated MLA is not supported by the reference model"
            )
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        kda_ids, mla_ids = config.kda_layer_ids, config.mla_layer_ids
        self._kind_idx = [
            kda_ids.index(i) if i in kda_ids else mla_ids.index(i)
            for i in range(config.num_hidden_layers)
        ]

    def step_graphs(self):
        """This model's CUDA graph runner (``StepGraphs``), or None off CUDA (NOTE 6) unless one
        was installed (``StepGraphs(model, capture=False)``, graphs NOTE 5)."""
        if getattr(self, "_graphs", None) is not None:
            return self._graphs
        if self.model.embed_tokens.weight.device.type != "cuda":
            return None
        from disagg.engine.reference.graphs import StepGraphs

        self._graphs = StepGraphs(self)
        return self._graphs

    def reset_graphs(self) -> None:
        """Drop the graph runner: its graphs read the weights where they were when captured, so a
        parameter given another tensor needs new ones (``cast_model`` and ``Module.to`` call this;
        weights copied in place, as the loaders do, keep them valid)."""
        self._graphs = None

    def _apply(self, fn, *args, **kwargs):  # .to / .cuda / .half move or cast every parameter
        self.reset_graphs()
        return super()._apply(fn, *args, **kwargs)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- forward ---------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seqs: list[SeqInput], absorbed: bool | None = None, graphs: bool = False,
                decode_graphs: bool = True) -> list[torch.Tensor]:
        """Logits per sequence: [1, vocab] for the last new token, or [n, vocab] with ``all_logits``.

        Args:
            seqs: sequences of this step (each: new token ids, start_pos, cache).
            absorbed: MLA form; None picks absorbed for 1-token steps, expanded otherwise.
            graphs: on CUDA, replay the token-wise parts of steps of up to ``MAX_GRAPH_TOKENS``
                tokens from captured CUDA graphs (NOTE 6).
            decode_graphs: with ``graphs``, a step of single-token sequences of one paged cache
                replays as one graph, its mixing included (NOTE 7).
        """
        assert seqs, "forward needs at least one sequence"
        device = self.model.embed_tokens.weight.device
        spans, offset = [], 0
        for s in seqs:
            n = int(s.input_ids.numel())
            assert s.input_ids.dim() == 1 and n > 0, "input_ids must be a non-empty 1-D tensor"
            assert s.start_pos >= 0, "start_pos must be >= 0"
            spans.append(TokenSpan(offset, n, s.start_pos, s.cache))
            offset += n
        ids = torch.cat([s.input_ids.to(device=device, dtype=torch.long) for s in seqs])
        decode, mixed = (None, spans) if absorbed is False else DecodeBatch.split(spans)  # NOTE 5
        pick = torch.cat(
            [
                torch.arange(sp.offset, sp.offset + sp.num_tokens)
                if s.all_logits
                else torch.tensor([sp.offset + sp.num_tokens - 1])
                for s, sp in zip(seqs, spans, strict=True)
            ]
        ).to(device)
        runner = self.step_graphs() if graphs and offset <= MAX_GRAPH_TOKENS else None
        h = None
        if runner is not None and decode_graphs and decode is not None and not mixed:  # NOTE 7
            h = runner.forward_decode(ids, pick, decode)
        if runner is not None and h is None:
            h = runner.forward(ids, pick, mixed, absorbed, decode)  # NOTE 6
        if h is None:
            h = self.model.embed_tokens(ids)
            for layer, kind_idx in zip(self.model.layers, self._kind_idx, strict=True):
                h = layer(h, mixed, kind_idx, absorbed, decode)
            h = h[pick]
        logits = self.lm_head(self.model.norm(h)).to(state_dtype(self.dtype))
        sizes = [sp.num_tokens if s.all_logits else 1 for s, sp in zip(seqs, spans, strict=True)]
        return list(logits.split(sizes))

    # -- construction ------------------------------------------------------------------
    @classmethod
    def random_init(
        cls,
        config: K3Config,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> K3ForCausalLM:
        """Deterministic random weights with peaked outputs (NOTE 3)."""
        model = cls(config)  # built on CPU (a meta build costs seconds on first use)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                p.copy_(_init_value(name, tuple(p.shape), config, gen))
        return cast_model(model, dtype, device).eval()

    def state_layout(
        self, model_id: str, block_size: int, dtype: torch.dtype | None = None
    ) -> StateLayout:
        """Geometry of this model's per-request state (for kv_transfer and the engine cache)."""
        c = self.config
        dtype = dtype or self.dtype
        name = str(dtype).removeprefix("torch.")
        return StateLayout(
            model_id=model_id,
            block_size=block_size,
            num_mla_layers=len(c.mla_layer_ids),
            latent_dim=c.latent_dim,
            num_kda_layers=len(c.kda_layer_ids),
            kda_heads=c.kda_num_heads,
            head_k=c.kda_head_dim,
            head_v=c.kda_head_dim,
            conv_width=c.conv_width,
            cache_dtype=name,
            conv_dtype=name,
            state_dtype=str(state_dtype(dtype)).removeprefix("torch."),
        )


def cast_model(
    model: K3ForCausalLM, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> K3ForCausalLM:
    """Move and cast, keeping the NOTE 2 parameters in fp32 for half dtypes."""
    model.to(device=device, dtype=dtype)
    if dtype in (torch.float16, torch.bfloat16):
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in FP32_PARAMS:
                p.data = p.data.float()
        model.reset_graphs()
    return model


def _init_value(
    name: str, shape: tuple[int, ...], config: K3Config, gen: torch.Generator
) -> torch.Tensor:
    """Initial value of one parameter (fp32, CPU)."""
    leaf = name.rsplit(".", 1)[-1]
    randn = lambda std: torch.randn(shape, generator=gen) * std
    uniform = lambda lo, hi: lo + (hi - lo) * torch.rand(shape, generator=gen)
    if leaf == "A_log":  # A in [1, 2]
        return uniform(1.0, 2.0).log()
    if leaf == "dt_bias":  # softplus(dt_bias) log-uniform in [1e-3, 5e-2]: alpha mostly 0.9-0.999
        dt = uniform(math.log(1e-3), math.log(5e-2)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "e_score_correction_bias":
        return randn(0.05)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("embed_tokens.weight"):
        return randn(1.0)
    if name == "lm_head.weight":
        return randn(LOGIT_STD / math.sqrt(shape[1]))
    if name.endswith("conv1d.weight"):
        return randn(1.0 / math.sqrt(shape[-1]))
    fan_in = shape[1]
    if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):  # residual branch outputs
        return randn(1.0 / math.sqrt(fan_in * 2 * config.num_hidden_layers))
    if name.endswith("f_b_proj.weight"):  # small data-dependent part of the decay
        return randn(0.3 / math.sqrt(fan_in))
    return randn(1.0 / math.sqrt(fan_in))
