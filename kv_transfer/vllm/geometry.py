"""What vLLM's KV cache groups mean in kv_transfer terms.

vLLM 0.33 describes a hybrid model's caches as *groups* (``KVCacheConfig``):
MLA groups (``MLAAttentionSpec``, one latent "head") and Mamba-type groups
(``MambaSpec``; KDA layers of Kimi Linear / K3 in mamba_cache_mode "align").
Every group draws block ids from one pool and indexes its own block table.

    layout block (S tokens)   |<------------- S ------------->|
    MLA group page            rows: S / dcp positions on this DCP rank
    KDA group blocks          one state block per mamba_block tokens; the state
                              after position p sits at index ceil(p / mamba_block) - 1

``CacheGeometry.from_vllm`` reads those groups (duck-typed: it never imports
vLLM) and builds the ``StateLayout`` the codec and the store use:

    block_size      S = the MLA group's token span (block_size x DCP)
    num_mla_layers  every layer of every MLA group, in model order
    latent_dim      the MLA page's last dim (576 for K3; 656 B rows for fp8_ds_mla)
    num_kda_layers  every layer of every Mamba group, in model order
    kda_heads       H_local x TP (the recurrent state is [H_local, K, V] per rank)
    conv_width      conv state rows + 1 (rows = kernel - 1 + speculative slots)

NOTES
1. Both connector roles derive the same geometry from the same config, so the
   scheduler (keys, lookups) and the workers (bytes) agree on the layout
   fingerprint without exchanging it.
2. A model with no Mamba group (pure MLA) gets ``num_kda_layers == 0``: its
   "KDA checkpoint" is an empty object that only marks a resume point.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer.objects import StateLayout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_order_key(name: str) -> tuple:
    """Natural sort key: ``model.layers.10`` after ``model.layers.9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _is_a(spec, class_name: str) -> bool:
    return any(c.__name__ == class_name for c in type(spec).__mro__)


def _is_mamba(spec) -> bool:
    return _is_a(spec, "MambaSpec")


def _is_mla(spec) -> bool:
    return _is_a(spec, "MLAAttentionSpec")


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One vLLM KV cache group as the connector uses it."""

    group_id: int  # index in KVCacheConfig.kv_cache_groups (and in block_ids tuples)
    kind: str  # "mla" | "kda"
    layer_names: tuple[str, ...]  # the group's layers, model order
    block_tokens: int  # tokens one block of this group covers (MLA: rows x DCP)


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """The connector's view of one engine's caches (identical on every rank)."""

    layout: StateLayout  # codec/store layout of this engine's state
    groups: tuple[GroupInfo, ...]  # MLA and KDA groups (other groups are ignored)
    mla_rows: int  # rows in one MLA page on one rank (S / dcp_size)
    mamba_block: int  # tokens per KDA state block (divides S)
    conv_shape: tuple[int, int]  # per-rank conv state as vLLM stores it (SD or DS)
    conv_transposed: bool  # vLLM keeps conv as [C, rows] ("DS"); objects are always [rows, C]
    state_shape: tuple[int, int, int]  # per-rank recurrent state [H_local, K, V]
    state_dtypes: tuple[torch.dtype, torch.dtype]  # (conv, recurrent) dtypes
    tp_size: int = 1  # tensor-parallel ranks (KDA heads are split over them)
    dcp_size: int = 1  # decode-context-parallel ranks (MLA positions are dealt over them)
    num_kv_groups: int = 1  # all groups vLLM has (block-level load errors need exactly one)
    mla_layer_index: dict[str, int] = field(default_factory=dict)  # layer name -> MLA layer slot

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def mla_groups(self) -> list[GroupInfo]:
        return [g for g in self.groups if g.kind == "mla"]

    @property
    def kda_groups(self) -> list[GroupInfo]:
        return [g for g in self.groups if g.kind == "kda"]

    def kda_block_index(self, position: int) -> int:
        """Index, in a KDA group's block table, of the state after ``position`` tokens."""
        assert position > 0, "no state before the first token"
        return math.ceil(position / self.mamba_block) - 1

    @classmethod
    def from_vllm(cls, kv_cache_config, model_id: str, *, tp_size: int = 1, dcp_size: int = 1,
                  conv_layout: str = "SD") -> CacheGeometry:
        """Derive the geometry from a vLLM ``KVCacheConfig``.

        Raises:
            ValueError: a cache geometry the connector cannot represent (no MLA
                group, mixed MLA page shapes, mixed KDA state shapes, a KDA
                block that does not divide the MLA block, an unknown conv layout).
        """
        if conv_layout not in ("SD", "DS"):
            raise ValueError(f"unknown conv state layout {conv_layout!r} (SD or DS)")
        groups: list[GroupInfo] = []
        mla_specs, kda_specs = [], []
        vllm_groups = list(kv_cache_config.kv_cache_groups)
        for gid, group in enumerate(vllm_groups):
            spec = group.kv_cache_spec
            names = tuple(sorted(group.layer_names, key=layer_order_key))
            if _is_mamba(spec):
                kda_specs.append(spec)
                groups.append(GroupInfo(gid, "kda", names, spec.block_size))
            elif _is_mla(spec):
                mla_specs.append(spec)
                sharded = getattr(spec, "dcp_sharded", True)
                groups.append(GroupInfo(gid, "mla", names, spec.block_size * (dcp_size if sharded else 1)))
        if not mla_specs:
            raise ValueError("the KV cache config has no MLA group: the K3 state connector needs one")
        ref = mla_specs[0]
        if any((s.block_size, s.head_size, s.dtype) != (ref.block_size, ref.head_size, ref.dtype) for s in mla_specs):
            raise ValueError("MLA groups with different page shapes or dtypes are not supported")
        mla_groups = [g for g in groups if g.kind == "mla"]
        block = mla_groups[0].block_tokens
        if any(g.block_tokens != block for g in mla_groups):
            raise ValueError("MLA groups with different token spans are not supported")
        mla_names = sorted((n for g in mla_groups for n in g.layer_names), key=layer_order_key)
        kda_names = sorted((n for g in groups if g.kind == "kda" for n in g.layer_names), key=layer_order_key)
        if kda_specs:
            k0 = kda_specs[0]
            if any((tuple(s.shapes), tuple(s.dtypes), s.block_size) != (tuple(k0.shapes), tuple(k0.dtypes), k0.block_size)
                   for s in kda_specs):
                raise ValueError("KDA groups with different state shapes are not supported")
            if len(k0.shapes) != 2:
                raise ValueError(f"expected (conv, recurrent) KDA states, got {len(k0.shapes)} states")
            conv_shape = tuple(k0.shapes[0])
            state_shape = tuple(k0.shapes[1])
            if block % k0.block_size:
                raise ValueError(f"KDA block {k0.block_size} does not divide the MLA block {block}")
            mamba_block = k0.block_size
            rows, channels = conv_shape if conv_layout == "SD" else conv_shape[::-1]
            heads, head_k, head_v = state_shape
            if channels != 3 * heads * head_k:
                raise ValueError(f"conv state channels {channels} != 3 x {heads} heads x {head_k}")
            dtypes = (k0.dtypes[0], k0.dtypes[1])
        else:  # pure MLA: an empty KDA object marks each resume point (NOTE 2)
            rows, heads, head_k, head_v = 0, 0, 1, 1
            conv_shape, state_shape = (0, 0), (0, 1, 1)
            mamba_block = block
            dtypes = (ref.dtype, torch.float32)
        layout = StateLayout(
            model_id=model_id, block_size=block, num_mla_layers=len(mla_names), latent_dim=ref.head_size,
            num_kda_layers=len(kda_names), kda_heads=heads * tp_size, head_k=head_k, head_v=head_v,
            conv_width=rows + 1, cache_dtype=_dtype_name(ref.dtype), conv_dtype=_dtype_name(dtypes[0]),
            state_dtype=_dtype_name(dtypes[1]),
        )
        return cls(layout, tuple(groups), ref.block_size, mamba_block, conv_shape, conv_layout == "DS",
                   state_shape, dtypes, tp_size, dcp_size, len(vllm_groups),
                   {n: i for i, n in enumerate(mla_names)})

    def mla_layer_names(self) -> list[str]:
        return sorted(self.mla_layer_index, key=self.mla_layer_index.__getitem__)

    def kda_layer_names(self) -> list[str]:
        return sorted((n for g in self.kda_groups for n in g.layer_names), key=layer_order_key)

    def group_ids(self, kind: str) -> list[int]:
        return [g.group_id for g in self.groups if g.kind == kind]


def block_ids_of(groups: Sequence[GroupInfo], block_ids: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """The block table of each listed group, out of vLLM's per-group tuple."""
    return {g.group_id: list(block_ids[g.group_id]) for g in groups}
