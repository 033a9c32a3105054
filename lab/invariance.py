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

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "lab_rows"
SWITCH = "DECODING_LAB_ROW_INVARIANT"  # "0" turns row-invariant forwards off (faster tree verification, not exact)
REDUCED = (torch.bfloat16, torch.float16)
_ROWWISE = contextvars.ContextVar("lab_rows_invariant", default=False)
_VISIBLE = contextvars.ContextVar("lab_rows_visible", default=None)  # (mask, shape, visible keys per row)


def _visible_keys(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[slice | torch.Tensor]:
    """Per query row, the keys it may see: a slice when they are a prefix (chains), else their indices (trees).
    The mask is the same for every layer of a forward, so the answer is computed once per mask."""
    cached = _VISIBLE.get()
    if cached is not None and cached[0] is attention_mask and cached[1] == (q_len, kv_len):
        return cached[2]
    if attention_mask is None:
        visible: list = [slice(0, kv_len - q_len + i + 1) for i in range(q_len)]
    else:
        rows = attention_mask[0, 0]
        rows = rows if rows.dtype == torch.bool else rows == 0  # [q, kv]
        counts = rows.sum(-1).tolist()
        prefix = (rows.cumsum(-1) == torch.arange(1, kv_len + 1, device=rows.device)).sum(-1).tolist()
        visible = [
            slice(0, n) if n == p else rows[i].nonzero()[:, 0]
            for i, (n, p) in enumerate(zip(counts, prefix, strict=True))
        ]
    _VISIBLE.set((attention_mask, (q_len, kv_len), visible))
    return visible


def row_invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA, or under `rows_invariant` one SDPA call per query row over the keys that row may see.

    query [B, heads, q, d], key / value [B, kv_heads, kv, d], attention_mask None (causal) or [B, 1, q, kv]."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or not _ROWWISE.get() or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs_row = {**kwargs, "is_causal": False}
    rows = []
    for i, visible in enumerate(_visible_keys(attention_mask, q_len, kv_len)):
        if isinstance(visible, slice):
            k, v = key[:, :, visible], value[:, :, visible]
        else:
            k, v = key.index_select(2, visible), value.index_select(2, visible)
        rows.append(sdpa_attention_forward(module, query[:, :, i : i + 1], k, v, None, **kwargs_row)[0])
    return torch.cat(rows, dim=1), None  # [B, q, heads, d]


AttentionInterface.register(ATTENTION, row_invariant_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


@contextlib.contextmanager
def rows_invariant(loaded) -> Iterator[None]:
    """Within this block, multi-token forwards of `loaded` compute rows as one-token steps (reduced precision)."""
    token = _ROWWISE.set(getattr(loaded.model, "_lab_rows_invariant", False))
    visible = _VISIBLE.set(None)
    try:
        yield
    finally:
        _VISIBLE.reset(visible)
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
