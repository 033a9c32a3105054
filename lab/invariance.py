"""Row-invariant forwards: a verify forward over n tokens computes each row exactly as a one-token decode step
would, so greedy verification decides exactly as greedy decoding in bf16 / fp16 (the dtype users run on a CPU).

Two things make a multi-token forward round differently from a one-token step in reduced precision:
- attention: a one-token step attends with one query row; a verify forward runs all rows in one SDPA call (other
  kernel, other reduction order). Under `rows_invariant`, the attention function `lab_rows` runs each query row
  over exactly the keys it may see (the prefix and its ancestors, in sequence order) with the one-query-row
  SDPA call a decode step makes, batched over the rows that see equally many keys (a tree level: SDPA computes
  each batch element alone); outside it (prefill, decode steps) it is plain SDPA. What it costs: each row reads
  the whole prefix (rows x prefix keys copied per layer) where one multi-row call reads it once.
- linear layers: for some shapes and inputs the CPU's bf16 kernel for one row (a matrix-vector product) and the
  3D batched path sum in another order than the 2D multi-row kernel, whose rows do not depend on how many rows
  there are. `make_rows_invariant` runs every linear layer as a 2D product and a one-row input as two identical
  rows (the multi-row kernel), so decode steps and verify rows agree bit for bit.
`DECODING_LAB_ROW_INVARIANT=0` turns both off at model load (faster verification, greedy equality only up to
bf16 ties again). In float32 neither is applied: float32 logits have the precision that makes ties rare (the
exactness tests show greedy equality there without it). Not covered: CUDA kernels (cuBLAS picks kernels by shape
too; not measured).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "lab_rows"
SWITCH = "DECODING_LAB_ROW_INVARIANT"  # "0" turns row-invariant forwards off (faster tree verification, not exact)
REDUCED = (torch.bfloat16, torch.float16)
_ROWWISE = contextvars.ContextVar("lab_rows_invariant", default=False)
_PLAN = contextvars.ContextVar("lab_rows_plan", default=None)  # (mask, shapes, row groups) of the last forward


@dataclass(frozen=True)
class _RowGroup:
    """Query rows that see the same number of keys: the whole cache prefix, then `tails` (their own keys)."""

    rows: torch.Tensor  # [G] query row indices
    tails: torch.Tensor  # [G, m] key indices after the prefix, in sequence order (m may be 0)
    contiguous: bool  # one row whose keys are positions [0, prefix + m): a chain row, attended on a view


def _seen_by_rows(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, q, kv] boolean or additive mask -> [q, kv] bool: which keys each query row may see."""
    rows = attention_mask[0, 0]
    return rows if rows.dtype == torch.bool else rows == 0


def _row_groups(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[_RowGroup] | None:
    """The rows of a verify forward grouped by how many keys each sees (its depth in a chain or tree), or None
    when some row does not see the whole cache prefix (then each row runs on its own). The mask is the same for
    every layer of a forward, so the answer is computed once per mask."""
    cached = _PLAN.get()
    if cached is not None and cached[0] is attention_mask and cached[1] == (q_len, kv_len):
        return cached[2]
    prefix = kv_len - q_len
    if attention_mask is None:
        visible = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
        sees_prefix = True
    else:
        rows = _seen_by_rows(attention_mask)
        sees_prefix = bool(rows[:, :prefix].all())
        visible = rows[:, prefix:]
    groups: list[_RowGroup] | None = None
    if sees_prefix:
        by_count: dict[int, list[int]] = {}
        for i, count in enumerate(visible.sum(-1).tolist()):
            by_count.setdefault(count, []).append(i)
        groups = []
        for members in by_count.values():
            tails = torch.stack([visible[i].nonzero()[:, 0] + prefix for i in members])
            contiguous = len(members) == 1 and bool(visible[members[0], : tails.shape[1]].all())
            groups.append(_RowGroup(torch.tensor(members, device=visible.device), tails, contiguous))
    _PLAN.set((attention_mask, (q_len, kv_len), groups))
    return groups


def _group_keys(states: torch.Tensor, prefix: int, group: _RowGroup) -> torch.Tensor:
    """[1, kv_heads, kv, d] -> [G, kv_heads, prefix + m, d]: the prefix, then each row's own keys."""
    groups, m = group.tails.shape
    if group.contiguous:
        return states[:, :, : prefix + m]  # a chain row: a view, no copy
    heads, dim = states.shape[1], states.shape[3]
    own = states[0].index_select(1, group.tails.flatten()).view(heads, groups, m, dim).transpose(0, 1)
    return torch.cat([states[:, :, :prefix].expand(groups, -1, -1, -1), own], dim=2)


def row_invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, or under `rows_invariant` one-query-row SDPA over exactly the keys each row may see, in sequence
    order (the call a decode step makes), batched over the rows that see equally many keys.

    query [B, heads, q, d], key / value [B, kv_heads, kv, d], attention_mask None (causal) or [B, 1, q, kv]."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or not _ROWWISE.get() or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs_row = {**kwargs, "is_causal": False}
    groups = _row_groups(attention_mask, q_len, kv_len)
    if groups is None:  # not a verify forward over a full prefix: each row alone over its visible keys
        out = [
            sdpa_attention_forward(
                module, query[:, :, i : i + 1], key[:, :, seen], value[:, :, seen], None, **kwargs_row
            )[0]
            for i, seen in enumerate(_seen_by_rows(attention_mask).unbind(0))
        ]
        return torch.cat(out, dim=1), None
    prefix = kv_len - q_len
    out = query.new_empty(1, q_len, query.shape[1], query.shape[3])  # [B, q, heads, d]
    for group in groups:
        rows_query = query[0].index_select(1, group.rows).transpose(0, 1).unsqueeze(2)  # [G, heads, 1, d]
        k, v = (_group_keys(states, prefix, group) for states in (key, value))
        attended = sdpa_attention_forward(module, rows_query, k, v, None, **kwargs_row)[0]  # [G, 1, heads, d]
        out[0].index_copy_(0, group.rows, attended[:, 0])
    return out, None


AttentionInterface.register(ATTENTION, row_invariant_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def rows_invariant(loaded) -> Iterator[None]:
    """Within this block, multi-token forwards of `loaded` compute rows as one-token steps (reduced precision)."""
    token = _ROWWISE.set(getattr(loaded.model, "_lab_rows_invariant", False))
    plan = _PLAN.set(None)
    try:
        yield
    finally:
        _PLAN.reset(plan)
        _ROWWISE.reset(token)


def _two_row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A 2D product for any input (3D inputs take another kernel path), a single row run as two identical rows."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    if flat.shape[0] == 1:
        out = nn.functional.linear(torch.cat([flat, flat]), self.weight, self.bias)[:1]
    else:
        out = nn.functional.linear(flat, self.weight, self.bias)
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def make_rows_invariant(model: nn.Module) -> list[str]:
    """Switch a reduced-precision CPU model to row-invariant forwards (module docstring); returns the names of
    the linear layers switched to the 2D / two-row product. A float32 or GPU model is left as it is."""
    weight = next(model.parameters(), None)
    if weight is None or weight.dtype not in REDUCED or weight.device.type != "cpu":
        return []
    if os.environ.get(SWITCH, "1") == "0":  # speed over bit-exact greedy equality (README: what it costs)
        return []
    config = model.config
    if getattr(config, "_attn_implementation", None) in ("sdpa", "eager", None):
        config._attn_implementation = ATTENTION
    switched = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
            module.forward = types.MethodType(_two_row_forward, module)
            switched.append(name)
    model._lab_rows_invariant = True
    return switched
