"""MLA (multi-head latent attention, DeepSeek-V2 style) with NoPE, as in Kimi Linear.

Per token x (H heads, R = kv_lora_rank, dn / dr / dv = nope / rope / v head dims):

    q              = q_proj(x)                      -> [H, dn + dr] = [q_nope | q_pe]
    [c_kv | k_pe]  = kv_a_proj_with_mqa(x)          -> [R + dr]
    cache row      = [kv_a_layernorm(c_kv) | k_pe]  -> latent_dim = R + dr values
    [k_nope | v]   = kv_b_proj(c)                   -> [H, dn + dv]
    k              = [k_nope | k_pe]  (k_pe shared by all heads; no rotary embedding)
    out            = o_proj( softmax(q k^T * (dn + dr)^-1/2, causal) v )

Absorbed form (decode): split kv_b_proj.weight [H*(dn+dv), R] per head into
W_UK [H, dn, R] and W_UV [H, dv, R]; then

    q_lat = q_nope W_UK                    -> [H, R]
    score = [q_lat | q_pe] . [c | k_pe]    (one latent KV head, latent_dim wide)
    out_h = (softmax(score) c) W_UV^T      -> [H, dv]

which equals the expanded form up to rounding.

Causal mask over history + new rows (query i is at absolute position start_pos + i):

    keys      0 .......... start_pos-1 | start_pos ... start_pos+n-1
    query i   sees every key j <= start_pos + i

NOTES
1. The cache holds one row per token per MLA layer, [normed c_kv | k_pe], in
   the cache dtype; attention reads the rows back in that dtype, so a token's
   row is the same whether it was computed in this step or an earlier one.
2. History rows are read before the step's rows are appended (a
   ``DecodeBatch`` appends first and masks instead).
3. ``kv_a_layernorm`` uses ``rms_norm_eps`` as vLLM does (HF's remote code
   leaves it at its 1e-6 default; the difference is below bf16 resolution).
4. On a GPU with a half-precision model the expanded (prefill) form runs
   the keys' up-projection and ``scaled_dot_product_attention`` in the model
   dtype, the attention with a
   lower-right causal bias (a fused kernel: no [H, n, T] score matrix, so 128K
   contexts fit); v is zero-padded to the q/k head dim. Everywhere else it is
   the explicit einsum in the compute dtype (the oracle tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.reference.layers import RMSNorm, TokenSpan, compute_dtype

if TYPE_CHECKING:
    from disagg.engine.reference.paged_cache import DecodeBatch


def _causal_mask(n: int, total: int, device) -> torch.Tensor:
    """True where query i (position total - n + i) must not see key j."""
    start = total - n
    qpos = torch.arange(start, total, device=device).unsqueeze(1)
    kpos = torch.arange(total, device=device).unsqueeze(0)
    return kpos > qpos


def _flash_lower_right(q, k, v, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention, query i at key position T - n + i, through SDPA's fused kernels (NOTE 4)."""
    from torch.nn.attention.bias import causal_lower_right

    n, total, d = q.shape[0], k.shape[0], q.shape[-1]
    vp = F.pad(v, (0, d - v.shape[-1])) if v.shape[-1] < d else v  # fused kernels want equal head dims
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, vp))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, total), scale=scale)
    return out[0].transpose(0, 1)[..., : v.shape[-1]].to(q.dtype)


def mla_expanded(q, latent, w_kv_b, *, kv_lora_rank: int, nope: int, v_dim: int, scale: float,
                 fused_dtype: torch.dtype | None = None):
    """q [n, H, dn+dr], latent [T, R+dr] (the last n rows are the queries' own) -> [n, H, dv].

    ``fused_dtype`` (CUDA, half models): attention in that dtype through a fused kernel (NOTE 4).
    """
    n, h, _ = q.shape
    total = latent.shape[0]
    c, k_pe = latent[:, :kv_lora_rank], latent[:, kv_lora_rank:]
    if fused_dtype is not None and q.is_cuda:  # the up-projection of every key, in the model dtype too
        kv = (c.to(fused_dtype) @ w_kv_b.to(fused_dtype).T).to(q.dtype).view(total, h, nope + v_dim)
    else:
        kv = (c @ w_kv_b.T).view(total, h, nope + v_dim)
    k_nope, val = kv[..., :nope], kv[..., nope:]
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(total, h, k_pe.shape[-1])], dim=-1)
    if fused_dtype is not None and q.is_cuda:
        return _flash_lower_right(q, k, val, scale, fused_dtype)
    scores = torch.einsum("nhd,thd->hnt", q, k) * scale
    scores = scores.masked_fill(_causal_mask(n, total, q.device), float("-inf"))
    return torch.einsum("hnt,thv->nhv", scores.softmax(-1), val)


def mla_absorbed(q, latent, w_kv_b, *, kv_lora_rank: int, nope: int, v_dim: int, scale: float):
    """Same contract as ``mla_expanded``, attending directly over latent rows."""
    n, h, _ = q.shape
    total = latent.shape[0]
    w = w_kv_b.view(h, nope + v_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_lat = torch.einsum("nhd,hdr->nhr", q[..., :nope], w_uk)
    q_full = torch.cat([q_lat, q[..., nope:]], dim=-1)  # [n, H, latent]
    scores = torch.einsum("nhl,tl->hnt", q_full, latent) * scale
    scores = scores.masked_fill(_causal_mask(n, total, q.device), float("-inf"))
    ctx = torch.einsum("hnt,tr->nhr", scores.softmax(-1), latent[:, :kv_lora_rank])
    return torch.einsum("nhr,hvr->nhv", ctx, w_uv)


class KimiMLAAttention(nn.Module):
    """One MLA layer; parameter names follow the HF / vLLM checkpoints."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_head_dim = self.nope + self.rope
        self.scale = self.q_head_dim**-0.5
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        else:  # DeepSeek-style low-rank query (names as in DeepSeek-V2/V3 checkpoints)
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-wise part: (q [N, H, dn+dr], cache rows [N, latent_dim])."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, : self.kv_lora_rank])
        rows = torch.cat([c, ckv[:, self.kv_lora_rank :]], dim=-1)
        return q.view(x.shape[0], self.num_heads, self.q_head_dim), rows

    # The layer runs in three parts (model NOTE 6): ``pre`` (= ``project``) and ``post`` are
    # token-wise, ``mix`` is the attention over each sequence's cached rows.
    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.project(x)

    def mix(self, pre, spans: list[TokenSpan], mla_idx: int, absorbed: bool | None = None,
            decode: DecodeBatch | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention -> [N, H, dv] in the compute dtype, written into ``out`` when given (every
        row that belongs to a sequence; other rows are left as they are)."""
        q, rows = pre
        cd = compute_dtype(q.dtype)
        w = self.kv_b_proj.weight.to(cd)
        if out is None:
            out = q.new_zeros(q.shape[0], self.num_heads, self.v_dim, dtype=cd)
        kw = dict(
            kv_lora_rank=self.kv_lora_rank, nope=self.nope, v_dim=self.v_dim, scale=self.scale
        )
        fused = q.dtype if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
        if decode is not None:
            out[decode.rows] = self._decode_batch(q[decode.rows].to(cd), rows[decode.rows], w, mla_idx, decode)
        for span in spans:
            hist = span.cache.mla_history(mla_idx)  # NOTE 2
            assert hist.shape[0] == span.start_pos, (
                f"MLA layer {mla_idx}: cache holds {hist.shape[0]} rows, start_pos is {span.start_pos}"
            )
            new = rows[span.rows].to(hist.dtype)
            span.cache.mla_append(mla_idx, new)
            latent = torch.cat([hist.to(new.device), new]).to(cd)  # NOTE 1
            use_absorbed = absorbed if absorbed is not None else span.num_tokens == 1
            if use_absorbed:
                out[span.rows] = mla_absorbed(q[span.rows].to(cd), latent, w, **kw)
            else:
                out[span.rows] = mla_expanded(q[span.rows].to(cd), latent, w, fused_dtype=fused, **kw)
        return out

    def post(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.o_proj(out.to(dtype).reshape(out.shape[0], self.num_heads * self.v_dim))

    def forward(
        self,
        x: torch.Tensor,
        spans: list[TokenSpan],
        mla_idx: int,
        absorbed: bool | None = None,
        decode: DecodeBatch | None = None,
    ) -> torch.Tensor:
        """``absorbed`` None: absorbed form for single-token steps, expanded otherwise.

        ``decode`` (absorbed form) batches single-token sequences of one paged
        cache; ``spans`` are the sequences left for the per-sequence loop.
        """
        return self.post(self.mix(self.pre(x), spans, mla_idx, absorbed, decode), x.dtype)

    def _decode_batch(self, q, new_rows, w_kv_b, mla_idx: int, batch: DecodeBatch) -> torch.Tensor:
        """Absorbed attention of B single tokens over their paged histories -> [B, H, dv]."""
        pool = batch.cache.mla[mla_idx]  # [blocks, bs, latent]
        pool.view(-1, pool.shape[-1]).index_copy_(0, batch.write_at, new_rows.to(pool.dtype))  # NOTE 1
        b = batch.size
        latent = pool[batch.tables].view(b, -1, pool.shape[-1]).to(q.dtype)  # [B, T, latent]
        w = w_kv_b.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        q_lat = torch.einsum("bhd,hdr->bhr", q[..., : self.nope], w[:, : self.nope])
        q_full = torch.cat([q_lat, q[..., self.nope :]], dim=-1)  # [B, H, latent]
        scores = torch.einsum("bhl,btl->bht", q_full, latent) * self.scale
        scores = scores.masked_fill(batch.masked.unsqueeze(1), float("-inf"))
        ctx = torch.einsum("bht,btr->bhr", scores.softmax(-1), latent[..., : self.kv_lora_rank])
        return torch.einsum("bhr,hvr->bhv", ctx, w[:, self.nope :])
