"""KDA (Kimi Delta Attention): gated delta rule with channel-wise decay.

Per head (key dim K, value dim V), token t, state S in R^{K x V} (key-major):

    q, k, v = SiLU(causal depthwise conv_4(W_q x)), ... ;  q, k L2-normalized, q *= K^-1/2
    g_t     = -exp(A_log[h]) * softplus(f_b(f_a(x_t)) + dt_bias)      (log decay, [K])
    beta_t  = sigmoid(b_proj(x_t))                                      (one per head)
    S_t     = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t     = S_t^T q_t
    out     = o_proj( RMSNorm_V(o) * w * sigmoid(g_b(g_a(x))) )

Chunkwise form (chunk C, inside a chunk G = cumsum(g), rows r, i):

    A[r, i] = beta_r sum_d k_r[d] k_i[d] exp(G_r[d] - G_i[d])   (i < r)
    M = (I + A)^-1 Diag(beta)         (forward substitution, >= fp32)
    W = M (exp(G) * K),  U = M V,  V' = U - W S
    O = (exp(G) * Q) S + tril_incl(sum_d q_r k_i exp(G_r - G_i)) V'
    S <- Diag(exp(G_last)) S + (exp(G_last - G) * K)^T V'

Every decay factor is exp of a non-positive number (no overflow): pairs within a
16-row sub-chunk use exp(G_r - G_i) directly, pairs across sub-chunks split it
at the sub-chunk's first row s as exp(G_r - G_s) * exp(G_s - G_i) (a matmul).

Chunks are aligned to ABSOLUTE positions (``kda_mix``):

    position  start_pos        next multiple of C                    end
              |-- recurrence --|--- C ---|--- C ---| ... |-- recurrence --|

so a prefill split at multiples of C repeats the arithmetic of an unsplit one.

NOTES
1. The conv state is vLLM's "SD" layout [conv_width - 1, 3*H*K]: the last
   (width - 1) raw projections, q | k | v along the last dim, oldest row first,
   in the model dtype. Conv weights are stored like a depthwise nn.Conv1d,
   [H*K, 1, width] (vLLM unsqueezes its [H*K, width] linear weight to this).
2. The recurrent state is [H, K, V] in fp32 (fp64 when the model is fp64); all
   of the sequence mixing runs in that dtype.
3. The fla-core kernels are used only for CUDA tensors when ``fla`` imports,
   and are imported lazily.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.reference.layers import RMSNorm, TokenSpan, compute_dtype, l2norm, state_dtype

if TYPE_CHECKING:
    from disagg.engine.reference.paged_cache import DecodeBatch

CHUNK = 64
SUB_CHUNK = 16  # pairwise-difference block inside a chunk (see _decayed_dots)
_CHUNK_GROUP_ELEMS = 1 << 23  # bound on the [chunks, H, C, SUB_CHUNK, K] temporaries


# -- pure functions over one sequence: q, k [T, H, K]; v [T, H, V]; g [T, H, K]; beta [T, H] --
def kda_recurrent(q, k, v, g, beta, state):
    """Token-by-token oracle. Returns (o [T, H, V], final state [H, K, V])."""
    s = state.clone()
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].exp().unsqueeze(-1)
        pred = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + (beta[t].unsqueeze(-1) * (v[t] - pred)).unsqueeze(1) * k[t].unsqueeze(-1)
        out.append(torch.einsum("hk,hkv->hv", q[t], s))
    o = torch.stack(out) if out else v.new_zeros(v.shape)
    return o, s


def _decayed_dots(a, b, G, sub: int = SUB_CHUNK):
    """D[r, i] = sum_d a_r[d] b_i[d] exp(G_r[d] - G_i[d]) for i <= r (0 above). [N, H, C, *] -> [N, H, C, C].

    Pairs inside a sub-chunk use the pairwise differences directly; pairs across
    sub-chunks factor through the sub-chunk's first row s (G_i >= G_s >= G_r):
    exp(G_r - G_i) = exp(G_r - G_s) * exp(G_s - G_i), both factors in (0, 1].
    """
    n, h, c, _ = a.shape
    out = a.new_zeros(n, h, c, c)
    for s0 in range(0, c, sub):
        s1 = min(c, s0 + sub)
        Gs = G[:, :, s0:s1]
        incl = torch.ones(s1 - s0, s1 - s0, dtype=torch.bool, device=a.device).tril()
        decay = (
            (Gs.unsqueeze(3) - Gs.unsqueeze(2)).masked_fill(~incl[:, :, None], float("-inf")).exp()
        )
        out[:, :, s0:s1, s0:s1] = (
            a[:, :, s0:s1].unsqueeze(3) * b[:, :, s0:s1].unsqueeze(2) * decay
        ).sum(-1)
        if s0:
            ref = G[:, :, s0 : s0 + 1]
            left = a[:, :, s0:s1] * (Gs - ref).exp()
            right = b[:, :, :s0] * (ref - G[:, :, :s0]).exp()
            out[:, :, s0:s1, :s0] = left @ right.transpose(-1, -2)
    return out


def _intra_chunk(q, k, v, g, beta):
    """State-independent parts of full chunks; inputs are [N, H, C, *] (beta [N, H, C])."""
    c = q.shape[2]
    G = g.cumsum(dim=2)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    A = (_decayed_dots(k, k, G) * beta.unsqueeze(-1)).masked_fill(~strict, 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * torch.cat([v, G.exp() * k], dim=-1)
    X = torch.linalg.solve_triangular(
        eye + A, rhs, upper=False, unitriangular=True
    )  # forward substitution
    U, W = X[..., : v.shape[-1]], X[..., v.shape[-1] :]
    P = _decayed_dots(q, k, G)  # lower triangle incl. the diagonal
    Qg = G.exp() * q
    Kd = (G[:, :, -1:] - G).exp() * k
    return U, W, P, Qg, Kd, G[:, :, -1].exp()


def kda_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunkwise-parallel KDA from the first token; a ragged tail uses the recurrence."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    n_full = t // chunk
    s = state.clone()
    outs = []
    if n_full:

        def heads_first(x):  # [n_full*C, H, D] -> [N, H, C, D]
            return x[: n_full * chunk].reshape(n_full, chunk, h, -1).permute(0, 2, 1, 3)

        qc, kc, vc, gc = map(heads_first, (q, k, v, g))
        bc = beta[: n_full * chunk].reshape(n_full, chunk, h).permute(0, 2, 1)
        per_chunk = h * chunk * SUB_CHUNK * dk
        group = max(1, _CHUNK_GROUP_ELEMS // per_chunk)
        for g0 in range(0, n_full, group):
            sl = slice(g0, min(n_full, g0 + group))
            U, W, P, Qg, Kd, last = _intra_chunk(qc[sl], kc[sl], vc[sl], gc[sl], bc[sl])
            for j in range(U.shape[0]):
                vp = U[j] - W[j] @ s  # [H, C, V]
                outs.append((Qg[j] @ s + P[j] @ vp).transpose(0, 1))  # [C, H, V]
                s = last[j].unsqueeze(-1) * s + Kd[j].transpose(-1, -2) @ vp
    if t > n_full * chunk:
        rest = slice(n_full * chunk, t)
        o_tail, s = kda_recurrent(q[rest], k[rest], v[rest], g[rest], beta[rest], s)
        outs.append(o_tail)
    o = torch.cat(outs) if outs else v.new_zeros(0, h, dv)
    return o, s


def kda_fla(q, k, v, g, beta, state, chunk_mode: bool = True):
    """fla-core kernels (CUDA only); q must already be normalized and scaled."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda  # lazy: needs triton

    fn = chunk_kda if chunk_mode else fused_recurrent_kda
    o, s = fn(
        q=q.unsqueeze(0),
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.float().unsqueeze(0),
        scale=1.0,
        initial_state=state.float().unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    return o[0].to(state.dtype), s[0].to(state.dtype)


@functools.cache
def _fla_importable() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except Exception:
        return False
    return True


def fla_available(t: torch.Tensor) -> bool:
    """fla kernels serve CUDA tensors below fp64 (fp64 runs are oracle runs).

    ``DISAGG_KDA_BACKEND=torch`` forces the plain torch path (for A/B figures).
    """
    if os.environ.get("DISAGG_KDA_BACKEND", "auto") == "torch":
        return False
    return t.device.type == "cuda" and t.dtype != torch.float64 and _fla_importable()


def kda_mix(
    q, k, v, g, beta, state, start_pos: int, chunk: int = CHUNK, use_fla: bool | None = None
):
    """KDA over new tokens at absolute positions start_pos.., chunks aligned to multiples of ``chunk``."""
    t = q.shape[0]
    if use_fla is None:
        use_fla = t > 1 and fla_available(q)
    head = min(t, (-start_pos) % chunk)
    parts = []
    s = state
    if head:
        args = (q[:head], k[:head], v[:head], g[:head], beta[:head], s)
        o, s = kda_fla(*args, chunk_mode=False) if use_fla else kda_recurrent(*args)
        parts.append(o)
    if t > head:
        args = (q[head:], k[head:], v[head:], g[head:], beta[head:], s)
        o, s = kda_fla(*args) if use_fla else kda_chunked(*args, chunk=chunk)
        parts.append(o)
    return torch.cat(parts), s


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv + SiLU. x [n, C], conv_state [W-1, C], weight [C, W].

    Returns (y [n, C] in the compute dtype, new conv state [W-1, C] in x's dtype).
    """
    width = weight.shape[-1]
    xp = torch.cat([conv_state.to(x.dtype), x], dim=0)
    cd = compute_dtype(x.dtype)
    windows = xp.to(cd).unfold(0, width, 1)  # [n, C, W]; tap W-1 is the current token
    y = F.silu((windows * weight.to(cd)).sum(-1))
    return y, xp[xp.shape[0] - (width - 1) :].clone()


class KimiDeltaAttention(nn.Module):
    """One KDA layer; parameter names follow the HF / vLLM checkpoints."""

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int, conv_width: int, eps: float
    ):
        super().__init__()
        d = num_heads * head_dim
        self.num_heads, self.head_dim, self.conv_width = num_heads, head_dim, conv_width
        self.q_proj = nn.Linear(hidden_size, d, bias=False)
        self.k_proj = nn.Linear(hidden_size, d, bias=False)
        self.v_proj = nn.Linear(hidden_size, d, bias=False)
        self.q_conv1d = nn.Conv1d(d, d, conv_width, groups=d, bias=False)  # weight [d, 1, W]
        self.k_conv1d = nn.Conv1d(d, d, conv_width, groups=d, bias=False)
        self.v_conv1d = nn.Conv1d(d, d, conv_width, groups=d, bias=False)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, d, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, d, bias=False)
        self.o_norm = RMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(d, hidden_size, bias=False)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay g [N, H, K] in the compute dtype."""
        cd = compute_dtype(x.dtype)
        f = self.f_b_proj(self.f_a_proj(x)).to(cd).view(-1, self.num_heads, self.head_dim)
        a = self.A_log.to(cd).view(self.num_heads, 1).exp()
        return -a * F.softplus(f + self.dt_bias.to(cd).view(self.num_heads, self.head_dim))

    def conv_weight(self) -> torch.Tensor:
        """The q | k | v depthwise conv weights as one [3*H*K, W] matrix, built once (and again
        only when a weight is replaced or changed in place)."""
        ws = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        if torch.is_grad_enabled():  # a cached tensor must not join an autograd graph
            return torch.cat([w[:, 0, :] for w in ws])
        key = tuple((w.data_ptr(), w._version) for w in ws)
        if getattr(self, "_conv_key", None) != key:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable outside inference mode
                self._conv_w = torch.cat([w[:, 0, :] for w in ws])
            self._conv_key = key
        return self._conv_w

    # The layer runs in three parts (model NOTE 6): ``pre`` and ``post`` are token-wise,
    # ``mix`` is the sequence mixing over each sequence's state.
    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-wise inputs of the mixing: (qkv [N, 3D] raw projections (NOTE 1), g [N, H, K],
        beta [N, H] in the state dtype, output gate [N, H, K])."""
        h, dk = self.num_heads, self.head_dim
        sd = state_dtype(x.dtype)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.decay(x).to(sd)
        beta = torch.sigmoid(self.b_proj(x).to(sd))
        gate = self.g_b_proj(self.g_a_proj(x)).view(-1, h, dk)
        return qkv, g, beta, gate

    def mix(self, pre, spans: list[TokenSpan], kda_idx: int, decode: DecodeBatch | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence mixing -> o [N, H, V] in the state dtype, written into ``out`` when given
        (every row that belongs to a sequence; other rows are left as they are)."""
        qkv, g, beta, _ = pre
        h, dk = self.num_heads, self.head_dim
        sd = g.dtype
        conv_w = self.conv_weight()
        o = out if out is not None else qkv.new_zeros(qkv.shape[0], h, dk, dtype=sd)
        if decode is not None:
            r = decode.rows
            o[r] = self._decode_batch(qkv[r], conv_w, g[r], beta[r], kda_idx, decode)
        for span in spans:
            conv_state, rec = span.cache.kda_state(kda_idx)
            y, new_conv = causal_conv(qkv[span.rows], conv_state, conv_w)
            q, k, v = (t.to(sd).reshape(-1, h, dk) for t in y.chunk(3, dim=-1))
            q = l2norm(q) * dk**-0.5
            k = l2norm(k)
            rows = span.rows
            o_seq, rec_new = kda_mix(q, k, v, g[rows], beta[rows], rec.to(sd), span.start_pos)
            assert rec_new.shape == rec.shape, "KDA state changed shape"
            span.cache.kda_update(kda_idx, new_conv, rec_new)
            o[rows] = o_seq
        return o

    def post(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gated output norm and projection of the mixing's output -> [N, hidden]."""
        cd = compute_dtype(dtype)
        y = self.o_norm(o.to(cd)) * torch.sigmoid(gate.to(cd))
        return self.o_proj(y.to(dtype).reshape(o.shape[0], self.num_heads * self.head_dim))

    def forward(
        self, x: torch.Tensor, spans: list[TokenSpan], kda_idx: int, decode: DecodeBatch | None = None
    ) -> torch.Tensor:
        """``decode`` batches single-token sequences of one paged cache (one recurrence step
        each); ``spans`` are the sequences left for the per-sequence path."""
        pre = self.pre(x)
        return self.post(self.mix(pre, spans, kda_idx, decode), pre[3], x.dtype)

    def _decode_batch(self, qkv, conv_w, g, beta, kda_idx: int, batch: DecodeBatch) -> torch.Tensor:
        """One token per sequence: conv + one delta-rule step for B slots at once -> o [B, H, V]."""
        h, dk = self.num_heads, self.head_dim
        sd = g.dtype
        conv_pool, rec_pool = batch.cache.conv[kda_idx], batch.cache.rec[kda_idx]
        xp = torch.cat([conv_pool[batch.slots].to(qkv.dtype), qkv.unsqueeze(1)], dim=1)  # [B, W, C]
        cd = compute_dtype(qkv.dtype)
        y = F.silu((xp.to(cd) * conv_w.to(cd).T.unsqueeze(0)).sum(1))  # tap W-1 = this token
        q, k, v = (t.to(sd).reshape(-1, h, dk) for t in y.chunk(3, dim=-1))
        q = l2norm(q) * dk**-0.5
        k = l2norm(k)
        s = rec_pool[batch.slots].to(sd) * g.exp().unsqueeze(-1)  # [B, H, K, V]
        pred = torch.einsum("bhk,bhkv->bhv", k, s)
        s = s + (beta.unsqueeze(-1) * (v - pred)).unsqueeze(2) * k.unsqueeze(-1)
        o = torch.einsum("bhk,bhkv->bhv", q, s)
        conv_pool.index_copy_(0, batch.slots, xp[:, 1:].to(conv_pool.dtype))
        rec_pool.index_copy_(0, batch.slots, s.to(rec_pool.dtype))
        return o
