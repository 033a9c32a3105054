"""Row-invariant forwards: a verify forward over n tokens computes each row exactly as a one-token decode step
would, at any thread count, so greedy verification decides exactly as greedy decoding in every dtype the lab runs
on a CPU (bf16 / fp16, float32; low-bit weights with either activation dtype).

What makes a multi-token forward round differently from a one-token step, and what is done about it:
- attention: a one-token step attends with one query row; a verify forward runs all rows in one SDPA call (other
  kernel, other reduction order, other rounding). A row-invariant model computes the attention of every
  one-token step and, under `rows_invariant`, of every verify forward with `exact_attention`: scores, softmax and
  the weighted sum of values in float64 from the bf16 / fp16 / float32 inputs, one masked call for all rows,
  rounded back to the input dtype once (its docstring gives the odds: ~1e-13 per element in bf16, ~1e-8 in
  float32; none seen in 2.5M float32 outputs of masked 11-row calls against rows alone). Prefill and batched
  forwards keep plain SDPA. What it costs: a handful of small float64 ops per layer instead of one SDPA call, on
  the decode step too. (Measured in float32 with strict MKL below, SDPA still gives 1690 of a 9-row chain's 2304
  logits other bits than the decode steps on one layer of SmolLM2-135M's shapes.)
- linear layers in bf16 / fp16: for some shapes and inputs the CPU's bf16 kernel for one row (a matrix-vector
  product) and the 3D batched path sum in another order than the 2D multi-row kernel, whose rows do not depend on
  how many rows there are. `make_rows_invariant` runs every linear layer as a 2D product and a one-row input as two
  identical rows (the multi-row kernel), so decode steps and verify rows agree bit for bit. These kernels (oneDNN)
  and the low-bit ones (ATen's and the op's, `lab.engine.quant`) split no sum by thread count: tested.
- linear layers in float32 run MKL's SGEMM, whose sums depend on both the row count and the thread count. Measured
  (torch 2.13, MKL 2024.2, AVX-512, `F.linear` of 17 random rows against 1, 2, 3, 5, 9 of them): at hidden 576
  (SmolLM2-135M: 576 -> 576, 192, 1536, 49152; 1536 -> 576) 90-95% of the elements of every product of fewer
  than 16 rows differ from the same rows of a 17-row product, 2D, 3D and doubled rows alike (e.g. 44839 of the
  LM head's 49152 outputs for one row), so the two-row trick does not help; products of 4 to 15 rows by 576 -> 576
  or 576 -> 192 also differ between 1 and 2 threads (e.g. 2620 of 2880 elements for 5 rows): the busy-machine
  case of the thread policy. At hidden 64, products of 1 and 2 rows (128 -> 64: up to 5) differ, with no thread
  dependence. Rows of 16 or more agree with each other and across thread counts. The fix: MKL's strict
  conditional numerical reproducibility (`mkl_cbwr_set(AUTO | STRICT)`, what `MKL_CBWR=AUTO,STRICT` sets), turned
  on by `_set_strict_blas` when this module is imported, which must be before MKL's first product in the process.
  With it no element of those products differs for any row count (1 to 33), 2D or 3D, at 1 to 16 threads
  (oversubscribed on 2 cores); float64 products run under the same mode. On an AMD EPYC (2026-12-06, MKL's auto
  branch MKL_CBWR_AUTO) strict mode still rounds products of 1 to 3 rows differently from longer ones (e.g. 528 of
  576 outputs of one row by 576 -> 576), while 4 or more rows agree at any count and thread count: float32 linears
  run with at least 4 rows (`_least_rows`). Float32 models get the float64 attention
  and the two-row linears as bf16 ones do (with strict MKL one row already takes the order of many; the 2D product
  is what its guarantee names). Where strict mode cannot be set (no MKL: aarch64 / macOS builds; or a product ran
  before lab was imported) float32 models are left plain and a warning says why (`BLAS_NOT_STRICT`).
  What it costs: strict MKL computes a one-row float32 product as it does a sixteen-row one, so float32 decode
  steps get slower while verify forwards do not (docs/benchmarks.md, "Float32 row invariance"); the C++ op's bf16
  steps do not use MKL. `lab.engine.defaults` times float32 decode steps as they now run, so dtype auto weighs it.
`DECODING_LAB_ROW_INVARIANT=0` turns the patches off at model load (faster verification, greedy equality only up to
ties again); set in the environment before lab is imported, it also leaves MKL in its default mode (float32 decode
steps at their old speed). Not covered: CUDA kernels (cuBLAS picks kernels by shape too; not measured), float32 on
CPUs without MKL, and other BLAS libraries (OpenBLAS, Accelerate: not measured).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import os
import types
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "lab_rows"
SWITCH = "DECODING_LAB_ROW_INVARIANT"  # "0" turns row-invariant forwards off (faster tree verification, not exact)
REDUCED = (torch.bfloat16, torch.float16)
COVERED = (*REDUCED, torch.float32)  # CPU dtypes whose models get row-invariant forwards (fp32: with strict BLAS)
FLOAT32_LEAST_ROWS = 4  # float32 products run with at least this many rows (`_least_rows`)
MKL_CBWR_ALL, MKL_CBWR_STRICT = ~0, 0x10000  # mkl_service.h: every setting; strict CNR (thread-count independent)
log = logging.getLogger(__name__)
_ROWWISE = contextvars.ContextVar("lab_rows_invariant", default=False)
_PLAN = contextvars.ContextVar("lab_rows_plan", default=None)  # (mask, (q, kv), hidden keys) of the last forward


def _set_strict_blas() -> str:
    """Turn on MKL's strict conditional numerical reproducibility (CNR) for this process; "" when it is on, else
    why not. MKL accepts the mode only before its first call in the process, so this runs when this module is
    imported (lab.engine.models imports it before any model exists); `DECODING_LAB_ROW_INVARIANT=0` at that time
    leaves MKL as it is. The mode is the one `MKL_CBWR=AUTO,STRICT` in the environment sets, set from here so that
    no launcher has to: PyTorch links MKL into libtorch_cpu, which exports MKL's service functions."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0 at import"
    if not torch.backends.mkl.is_available():
        return "PyTorch runs float32 products without MKL here"
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get, auto, set_mode = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_get_auto_branch, lib.mkl_serv_cbwr_set
    except (OSError, AttributeError) as error:
        return f"MKL's CNR functions are not reachable ({error})"
    if get(MKL_CBWR_ALL) & MKL_CBWR_STRICT:
        return ""  # already on (MKL_CBWR in the environment, or an earlier import)
    code = set_mode(auto() | MKL_CBWR_STRICT)
    if code != 0:  # -8: MKL already ran a product in this process
        return f"MKL refused strict CNR (code {code}: a float32 or float64 product ran before lab was imported)"
    return ""


BLAS_NOT_STRICT = _set_strict_blas()  # "" when float32 / float64 products are row- and thread-invariant (docstring)


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
    """softmax(q k^T * scaling) v in float64 from bf16 / fp16 / float32 inputs, rounded back once at the end.

    query [1, heads, q, d], key / value [1, kv_heads, kv, d] (grouped-query heads share a kv head), mask as
    for SDPA; returns [1, q, heads, d]. Masked keys get weight exactly 0. The odds that a row's output depends on
    the other rows or the masked keys of the call (through the order in which the kernel adds):
    - bf16 / fp16: a product of two inputs (8 or 11 significant bits) is exact in float64 and a sum of d of them
      is exact too (barring an exponent spread over ~30 bits), so every score is the same number whatever the
      kernel, the row count or the key count; softmax and the weighted sum of values carry 53 bits, so the order
      in which they add changes the float64 result by about 1e-16 relative, and the output rounded to bf16 differs
      only where that lands on a rounding boundary (odds of about 1e-13 per element).
    - float32: a product of two inputs (24 significant bits each, 48 in all) is exact in float64, but a sum of d
      of them is not: each score carries a relative error of a few 2^-53 that depends on the order of the adds,
      as do the softmax and the weighted sum. The output rounded to float32 (24 bits) differs only where the
      float64 result lies within that error of a float32 rounding boundary: odds of a few 2^-53 / 2^-24, about
      1e-8 per element (some 1e-4 per verify row of a 30-layer model with 576 attention outputs a layer). With
      MKL's strict mode on (module docstring) and without it, none was seen: 0 of 2.5M float32 outputs of
      masked 11-row calls (9 heads of 64, 20 to 300 keys) differed from the rows computed alone over their keys."""
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
    """A 2D product for any input (3D inputs take another kernel path), with at least `_least_rows` rows: a short
    input is padded with copies of its first row and the padding's outputs dropped."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, in]
    rows = flat.shape[0]
    least = _least_rows(flat.dtype)
    if 0 < rows < least:
        padded = torch.cat([flat, flat[:1].expand(least - rows, -1)])
        out = nn.functional.linear(padded, self.weight, self.bias)[:rows]
    else:
        out = nn.functional.linear(flat, self.weight, self.bias)
    return out.reshape(*x.shape[:-1], self.weight.shape[0])


def _least_rows(dtype: torch.dtype) -> int:
    """The fewest rows a row-invariant product runs with: 2 in bf16 / fp16 (one row would take the matrix-vector
    kernel; the C++ op's float linears do the same), 4 in float32 (under strict CNR, MKL's SGEMM on an AMD EPYC,
    whose auto branch is MKL_CBWR_AUTO, rounds products of 1 to 3 rows differently from products of 4 or more, which
    agree with each other; on Intel CPUs every row count already agrees, so the padding changes no bits there)."""
    return FLOAT32_LEAST_ROWS if dtype == torch.float32 else 2


def make_rows_invariant(model: nn.Module) -> list[str]:
    """Switch a CPU model in bf16 / fp16 / float32 to row-invariant forwards (module docstring); returns the names of
    the linear layers switched to the 2D / two-row product. A GPU model, and a float32 model where MKL's strict
    mode is not on (`BLAS_NOT_STRICT` says why; logged once), are left as they are."""
    weight = next(model.parameters(), None)
    if weight is None or weight.dtype not in COVERED or weight.device.type != "cpu":
        return []
    if os.environ.get(SWITCH, "1") == "0":  # speed over bit-exact greedy equality (docs/benchmarks.md: what it costs)
        return []
    if weight.dtype == torch.float32 and BLAS_NOT_STRICT:
        if not getattr(make_rows_invariant, "_warned", False):
            make_rows_invariant._warned = True
            log.warning("float32 forwards are not row-invariant: %s", BLAS_NOT_STRICT)
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
