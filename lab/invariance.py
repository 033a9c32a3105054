"""Row-invariant forwards: a verify forward over n tokens computes each row exactly as a one-token decode step
would, so greedy verification decides exactly as greedy decoding in bf16 / fp16 (the dtype users run on a CPU).

Two things make a multi-token forward round differently from a one-token step in reduced precision:
- attention: a one-token step attends with one query row; a verify forward runs all rows in one SDPA call (other
  kernel, other reduction order). Under `rows_invariant`, the attention function `lab_rows` runs each query row
  on its own, over exactly the keys it may see (the prefix and its ancestors, in sequence order), with the same
  SDPA call a decode step makes; outside it (prefill, decode steps) it is plain SDPA.
- linear layers: for some shapes and inputs the CPU's bf16 kernel for one row (a matrix-vector product) and the
  3D batched path sum in another order than the 2D multi-row kernel, whose rows do not depend on how many rows
  there are. `make_rows_invariant` runs every linear layer as a 2D product and a one-row input as two identical
  rows (the multi-row kernel), so decode steps and verify rows agree bit for bit.
In float32 neither is applied: float32 logits have the precision that makes ties rare (the exactness tests show
greedy equality there without it). Not covered: CUDA kernels (cuBLAS picks kernels by shape too; not measured).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "lab_rows"
REDUCED = (torch.bfloat16, torch.float16)
_ROWWISE = contextvars.ContextVar("lab_rows_invariant", default=False)


def row_invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, or under `rows_invariant` one SDPA call per query row over the keys that row may see.

    query [B, heads, q, d], key / value [B, kv_heads, kv, d], attention_mask None (causal) or [B, 1, q, kv]."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or not _ROWWISE.get() or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for i in range(q_len):
        if attention_mask is None:
            visible = slice(0, kv_len - q_len + i + 1)
            k, v = key[:, :, visible], value[:, :, visible]
        else:
            row = attention_mask[0, 0, i]
            index = (row if row.dtype == torch.bool else row == 0).nonzero()[:, 0]  # [n_visible]
            k, v = key.index_select(2, index), value.index_select(2, index)
        kwargs_row = {**kwargs, "is_causal": False}
        rows.append(sdpa_attention_forward(module, query[:, :, i : i + 1], k, v, None, **kwargs_row)[0])
    return torch.cat(rows, dim=1), None  # [B, q, heads, d]


AttentionInterface.register(ATTENTION, row_invariant_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def rows_invariant(loaded) -> Iterator[None]:
    """Within this block, multi-token forwards of `loaded` compute rows as one-token steps (reduced precision)."""
    token = _ROWWISE.set(getattr(loaded.model, "_lab_rows_invariant", False))
    try:
        yield
    finally:
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
