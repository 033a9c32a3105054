"""Row-invariant forwards: a verify forward over n tokens computes each row exactly as a one-token decode step
would, so greedy verification decides exactly as greedy decoding in bf16 / fp16 (the dtype users run on a CPU).

Two things make a multi-token forward round differently from a one-token step in reduced precision:
- attention: a one-token step attends with one query row; a verify forward runs all rows in one SDPA call (other
  kernel, other reduction order, other rounding). A row-invariant model computes the attention of every
  one-token step and, under `rows_invariant`, of every verify forward with `exact_attention`: scores, softmax and
  the weighted sum of values in float64 from the bf16 inputs, one masked call for all rows, rounded back to
  bf16 once. Scores of bf16 inputs are exact in float64 and the rest carries 53 bits, so a row's bf16 output
  does not depend on which other rows or masked keys share the call (see its docstring for the odds). Prefill
  and batched forwards keep plain SDPA. What it costs: a handful of small float64 ops per layer instead of one
  SDPA call, on the decode step too.
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
_PLAN = contextvars.ContextVar("lab_rows_plan", default=None)  # (mask, (q, kv), hidden keys) of the last forward


def _hidden_keys(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """[q, kv] bool, True where a query row may not see a key; None when every row sees every key. A missing
    mask on several rows means causal. The answer is the same for every layer of a forward: computed once."""
    if attention_mask is None and q_len == 1:
        return None
    cached = _PLAN.get()
    if cached is not None and cached[0] is attention_mask and cached[1] == (q_len, kv_len):
        return cached[2]
    if attention_mask is None:  # causal: row i sees the cache and the new rows up to its own
        hidden = torch.arange(kv_len).unsqueeze(0) > torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
    else:
        rows = attention_mask[0, 0]
        hidden = ~rows if rows.dtype == torch.bool else rows != 0
    _PLAN.set((attention_mask, (q_len, kv_len), hidden))
    return hidden


def exact_attention(query, key, value, attention_mask, scaling: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scaling) v in float64 from reduced-precision inputs, rounded back once at the end.

    query [1, heads, q, d], key / value [1, kv_heads, kv, d] (grouped-query heads share a kv head), mask as
    for SDPA; returns [1, q, heads, d]. A product of two bf16 / fp16 values is exact in float64 and a sum of d
    of them is exact too (barring an exponent spread over ~30 bits), so every score is the same number
    whatever the kernel, the row count or the key count; softmax and the weighted sum of values carry 53 bits,
    so the order in which they add (which does depend on the shapes) changes the float64 result by about
    1e-16 relative, and the output rounded to bf16 differs only where that lands on a rounding boundary
    (odds of about 1e-13 per element). Masked keys get weight exactly 0."""
    _, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    shared = heads // kv_heads  # query heads per kv head (repeat_kv's layout: head h reads kv head h // shared)
    q = query[0].to(torch.float64).reshape(kv_heads, shared * q_len, dim)
    k, v = key[0].to(torch.float64), value[0].to(torch.float64)
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(dim**-0.5 if scaling is None else scaling)
    hidden = _hidden_keys(attention_mask, q_len, kv_len)
    if hidden is not None:
        scores.view(kv_heads, shared, q_len, kv_len).masked_fill_(hidden, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [kv_heads, shared * q, d]
    return out.view(heads, q_len, dim).transpose(0, 1).unsqueeze(0).to(query.dtype)


def row_invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention of a row-invariant model: `exact_attention` for every one-token step and, under
    `rows_invariant`, for every verify forward, so each verify row computes what the decode step along its
    path computes; plain SDPA for prefill and batched forwards (nothing compares their rows with a step).

    query [B, heads, q, d], key / value [B, kv_heads, kv, d], attention_mask None (causal) or [B, 1, q, kv]."""
    if query.shape[0] != 1 or (query.shape[2] > 1 and not _ROWWISE.get()):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return exact_attention(query, key, value, attention_mask, kwargs.get("scaling")), None


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
    if os.environ.get(SWITCH, "1") == "0":  # speed over bit-exact greedy equality (docs/benchmarks.md: what it costs)
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
