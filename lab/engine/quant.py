"""Low-bit linears for CPU decoding: int8 per output channel, 4-bit groups, and 4-bit groups times 8-bit activation
blocks (issues 17 and 28).

A decode step of a small model reads every weight once, so its time is bytes over memory bandwidth; storing
the weights in fewer bits and multiplying them with PyTorch's CPU kernels cuts those bytes:
- `Int8Linear`: w = s_n q_nk with q in [-127, 127] and one scale per output channel (absmax / 127), computed by
  `torch._weight_int8pack_mm` (activations stay in the run's dtype).
- `Int4Linear`: GGUF Q4_1 groups of 32 along the input dimension, w = d q + m with q in [0, 15] and one scale d
  and minimum m per group (ggml's `block_q4_1`), computed by `torch._weight_int4pack_mm_for_cpu`, whose
  dequantization is (q - 8) s + z, so s = d and z = m + 8 d.
- `W4A8Linear` (precision "w4a8"): the same Q4_1 groups (d and m stored in fp16, as ggml does) times activations
  quantized per row to 8-bit blocks of 32 (d_x = max |x| / 127, q = round_half_even(x / d_x)), with integer dot
  products per block: y = sum_g (d_w d_x) sum_j w_j q_j + m_w d_x sum_j q_j, llama.cpp's numerics for Q4_1 weights
  (its Q8_1 activation blocks). The op's kernel (lab/engine/native/lowbit_w4a8.cpp; AVX-512 VNNI, AVX-VNNI, AVX2 or
  plain C++, chosen at run time) and `w4a8_reference` (PyTorch, where the op is not built) give the same bits, and a
  row's result depends neither on the other rows nor on the thread count, so every lossless method keeps greedy's
  output at this precision too. Differences from ggml: d_x stays float32 (ggml rounds it to fp16), the rounding is
  half to even (ggml's roundf rounds halves away from zero), and the blocks are added in a fixed order in float32.
  With its Q8_0 LM head it agrees with the float model about as well as int4 (docs/benchmarks.md, quality per
  precision), and it is the CPU default where the op is built (`lab.engine.defaults`).
- `W8A8Linear` (the LM head at precision "w4a8"): ggml's Q8_0 blocks (w = d q, q in [-128, 127], d in fp16 per 32
  inputs; the GGUF's own when it stores the head or the tied embedding so) times the same 8-bit activation blocks:
  y = sum_g (d_w d_x) sum_j q_w,j q_x,j in block order, llama.cpp's numerics for a Q8_0 tensor
  (lab/engine/native/lowbit_w8a8.cpp; `w8a8_reference` gives the same bits in PyTorch). `W8A8Linear.rows` gives a
  draft head the rows of its draft vocabulary.
- `quantize_model(model, precision, gguf_path)`: replaces the decoder layers' linears and the LM head in place.
  With a GGUF file whose linears are Q4_1 (the embedded model), int4 and w4a8 take the file's own blocks (the same
  weights the file holds, no second rounding); otherwise the groups are quantized from the float weights with
  ggml's Q4_1 rule (d = (max - min) / 15, m = min, q = round((w - m) / d)). The LM head goes to int8 per
  channel at int8 and int4, to Q8_0 blocks at w4a8 (the embedded file stores it as Q8_0, finer than 4 bits).
  Weight tying is kept working: the input embedding is a separate module and keeps its own float weight.
- `resolve_precision("auto", ...)`: bf16 (no weight quantization) on CUDA and MPS; on CPU the choice of
  `lab.engine.defaults` (low-bit weights always with the bfloat16 activations their kernels are fast in).
- With bf16 activations and the C++ op built (`lab.engine.native_forward`), both linears run the op's own products
  (lab/engine/native/lowbit_mm.h): each weight tile unpacked once for all rows of a forward, each output the bits
  of ATen's AVX-512 kernel (tested against it for every instruction-set variant the CPU runs), so a verify forward
  of M rows no longer costs ATen's unpacking per block of 4 rows. Until the op is loaded, without a compiler, or
  with `DECODING_LAB_LOWBIT=0` (`set_lowbit_kernels`), ATen's kernels run: the same bits on a CPU where ATen runs
  its AVX-512 kernels (elsewhere ATen's AVX2 or plain kernels round differently, and the op is what a run uses
  once it is built).
Hidden states, norms, attention and the embedding are untouched, so early exits (DoLa) and the draft heads
(EAGLE, Medusa, MTPC) see the same kind of tensors at every precision; a quantized module's `weight` property
dequantizes on demand for code that reads the matrix (the heads' LM-head rows).
Not covered: activation quantization of the int8 LM head (w4a8's head has it), GPU kernels (CUDA keeps bf16),
Medusa's and MTPC's heads (EAGLE's head takes the target's precision: `lab.heads.eagle.serving_head`), layers whose
shapes the 4-bit kernel refuses (output features not divisible by 16 or input features by the group) take int8.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

PRECISIONS = ("auto", "bf16", "int8", "int4", "w4a8")
GROUP = 32  # ggml's QK4_1: weights per Q4_1 block
# `_convert_weight_to_int4pack_for_cpu` interleaves output channels in blocks of 64 (a last, partial block packs
# differently), so packed weights can be stacked only after parts whose output sizes are multiples of 64
INT4_PACK_BLOCK = 64
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
GGUF_NAMES |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


@dataclass(frozen=True)
class Q4Groups:
    """Asymmetric 4-bit groups of one [N, K] matrix: w[n, g*32 + j] = d[n, g] q[n, g*32 + j] + m[n, g]."""

    q: torch.Tensor  # [N, K] int32 in [0, 15]
    d: torch.Tensor  # [N, K / 32] float32
    m: torch.Tensor  # [N, K / 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.float().reshape(n, k // GROUP, GROUP)
        return (self.d[..., None] * groups + self.m[..., None]).reshape(n, k)  # [N, K]


def q4_from_weight(weight: torch.Tensor) -> Q4Groups:
    """ggml's reference Q4_1 quantization (quantize_row_q4_1_ref) of a float [N, K] matrix."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((groups - low[..., None]) * inverse[..., None] + 0.5).floor().clamp(0, 15)
    return Q4Groups(q.to(torch.int32).reshape(n, k), d, low)


def q4_from_gguf_blocks(raw: np.ndarray, n: int, k: int) -> Q4Groups:
    """Parse GGUF Q4_1 bytes ([N, K/32 * 20] uint8, rows of `block_q4_1 {half d; half m; uint8 qs[16]}`):
    element j of a block is the low nibble of qs[j], element j + 16 the high nibble (ggml dequantize_row_q4_1)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # [N, K/32, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return Q4Groups(torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m))


def permute_rows_like_hf(groups: Q4Groups, heads: int) -> Q4Groups:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k as transformers' GGUF loader does (rows
    [head, dim/2, 2] read as [head, 2, dim/2]). Blocks run along K, so permuting rows keeps them whole."""
    n = groups.q.shape[0]
    order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return Q4Groups(groups.q[order], groups.d[order], groups.m[order])


LOWBIT_SWITCH = "DECODING_LAB_LOWBIT"  # "0": ATen's low-bit kernels everywhere (the same bits, slower verifies)
_native = None  # lab.engine.native_forward, imported on first use (it imports this module)
_kernels_on: bool | None = None  # None: not set yet (the switch decides on first use)


def set_lowbit_kernels(on: bool) -> None:
    """Use the op's row-efficient low-bit products (on) or ATen's (off) in the linears and the native decoder
    layers from now on (A/B measurements; both give the same bits)."""
    global _kernels_on
    _kernels_on = on
    if _lowbit_ops(any_setting=True) is not None:
        torch.ops.decoding_lab.lowbit_active(on)


def _lowbit_ops(any_setting: bool = False):
    """`torch.ops.decoding_lab` once the native op is loaded (its row-efficient low-bit products) and they are on,
    else None (the first call starts its build in the background, as a forward would)."""
    global _native, _kernels_on
    if _native is None:
        from lab.engine import native_forward

        _native = native_forward
    if _kernels_on is None:
        _kernels_on = os.environ.get(LOWBIT_SWITCH, "1") != "0"
    if not _native.available():
        return None
    return torch.ops.decoding_lab if _kernels_on or any_setting else None


_int4_layout: int | None = None  # ATen's packed int4 layout as the op found it (-1: one it does not read)


def _int4_ops():
    """`_lowbit_ops()` when its int4 product reads the packed layout of this PyTorch build, else None."""
    global _int4_layout
    ops = _lowbit_ops()
    if ops is not None and _int4_layout is None:
        _int4_layout = int(ops.int4_layout())
    return ops if ops is not None and _int4_layout >= 0 else None


def _activations(x: torch.Tensor, features: int, dtype: torch.dtype) -> torch.Tensor:
    """x as the contiguous [M, K] matrix in `dtype` that the low-bit kernels take (no copy when it already is)."""
    flat = x.reshape(-1, features)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat if flat.is_contiguous() else flat.contiguous()


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 per output channel (`torch._weight_int8pack_mm`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        w = weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
        self.register_buffer("qweight", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix [N, K] (for code that reads the weights, e.g. the heads' LM-head rows)."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    @classmethod
    def rows(cls, source: Int8Linear, index: torch.Tensor) -> Int8Linear:
        """A linear of the output rows `index` of `source`, the same int8 values and scales (a draft head's
        logits over its draft vocabulary from the target's LM head)."""
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        index = index.long().to(source.qweight.device)
        linear.register_buffer("qweight", source.qweight.index_select(0, index).contiguous())
        linear.register_buffer("scales", source.scales.index_select(0, index).contiguous())
        bias = source.bias
        linear.register_buffer("bias", None if bias is None else bias.index_select(0, index).contiguous())
        linear.in_features, linear.out_features = source.in_features, int(index.numel())
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers  # direct reads: a decode step makes ~150 of these calls (issue 17, overhead)
        scales, bias = buffers["scales"], buffers["bias"]
        flat = _activations(x, self.in_features, scales.dtype)  # [M, K]
        ops = _lowbit_ops() if scales.dtype == torch.bfloat16 and self.in_features % 16 == 0 else None
        if ops is not None:  # the same bits, each weight read once for all rows (lab/engine/native/lowbit_mm.h)
            y = ops.int8_mm(flat, buffers["qweight"], scales)
        else:
            y = torch._weight_int8pack_mm(flat, buffers["qweight"], scales)  # [M, N]
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """y = x W^T + b with W as 4-bit groups of 32 (Q4_1), `torch._weight_int4pack_mm_for_cpu`."""

    def __init__(self, groups: Q4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        n, k = groups.q.shape
        zeros = groups.m + 8 * groups.d  # the kernel dequantizes (q - 8) s + z
        scales_and_zeros = torch.stack([groups.d, zeros], -1).transpose(0, 1).contiguous()  # [K/32, N, 2]
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(groups.q.contiguous(), 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = k, n

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix [N, K], computed by the kernel itself on an identity input."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype, device=self.packed.device)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        scales_and_zeros, bias = buffers["scales_and_zeros"], buffers["bias"]
        flat = _activations(x, self.in_features, scales_and_zeros.dtype)  # [M, K]
        ops = _int4_ops() if scales_and_zeros.dtype == torch.bfloat16 else None
        if ops is not None:  # the same bits, each weight unpacked once for all rows
            y = ops.int4_mm(flat, buffers["packed"], scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(flat, buffers["packed"], GROUP, scales_and_zeros)  # [M, N]
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)


A8_TILE = 16  # output columns per tile of the w4a8 and w8a8 layouts (lab/engine/native/lowbit_a8.h)


def pack_w4a8(groups: Q4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The w4a8 layout of Q4_1 groups: packed [N / 16, K / 32, 256] uint8 (per tile of 16 columns and block, 4
    parts of 64 bytes; byte 4c + i of part p holds input 8p + i of column c in its low nibble, input 8p + 4 + i in
    its high one) and scales [N / 16, K / 32, 2, 16] int16, the bits of fp16 values (d, then m, as ggml's block_q4_1
    stores them; integer so that a module's `.to(dtype)` leaves them alone)."""
    n, k = groups.q.shape
    tiles, blocks = n // A8_TILE, k // GROUP
    q = groups.q.to(torch.uint8).reshape(tiles, A8_TILE, blocks, 4, 2, 4)  # [t, c, g, p, high, i]
    q = q.permute(0, 2, 3, 1, 5, 4)  # [t, g, p, c, i, high]
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, blocks, 4 * 64).contiguous()
    scales = torch.stack([groups.d, groups.m])  # [2, N, K / 32]
    scales = scales.to(torch.float16).reshape(2, tiles, A8_TILE, blocks).permute(1, 3, 0, 2).contiguous()
    return packed, scales.view(torch.int16)


def unpack_w4a8(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_w4a8` undone: q [N, K] uint8 in [0, 15], d and m [N, K / 32] float32 (the fp16 values, widened)."""
    tiles, blocks = packed.shape[:2]
    parts = packed.reshape(tiles, blocks, 4, A8_TILE, 4)  # [t, g, p, c, i]
    q = torch.stack([parts & 15, parts >> 4], dim=-1)  # [t, g, p, c, i, high]
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(tiles * A8_TILE, blocks * GROUP)
    d, m = scales.view(torch.float16).float().permute(2, 0, 3, 1).reshape(2, tiles * A8_TILE, blocks)
    return q, d, m


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the w4a8 product (lowbit_w4a8.cpp): each row of x [M, K] in blocks of 32, d = max |x| / 127,
    q = round_half_even(x * (1 / d)) (0 where d = 0), s = d * sum(q); returns q [M, K / 32, 32] float (integers),
    d and s [M, K / 32] float32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // GROUP, GROUP)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None])
    return q, d, d * q.sum(-1)


def w4a8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The w4a8 product in PyTorch, bit for bit the op's (steps 2 and 3 of lowbit_w4a8.cpp): x [M, K] times the
    unpacked weights (q [N, K], d / m [N, K / 32]) -> [M, N] in x's dtype. The block dot products are exact in a
    float32 matrix product (integers below 2^24); the blocks are then added in order, one rounding per operation."""
    xq, dx, sx = quantize_activations(x)  # [M, G, 32], [M, G]
    blocks = xq.shape[1]
    weights = q.float().reshape(q.shape[0], blocks, GROUP).permute(1, 2, 0)  # [G, 32, N]
    dots = torch.bmm(xq.transpose(0, 1), weights).permute(1, 2, 0)  # [M, N, G]
    products = (d[None] * dx[:, None]) * dots  # (d_w d_x) i
    offsets = m[None] * sx[:, None]  # m_w s
    acc = torch.zeros(x.shape[0], q.shape[0])
    for g in range(blocks):
        acc = acc + products[..., g]
        acc = acc + offsets[..., g]
    return acc.to(x.dtype)


class W4A8Linear(nn.Module):
    """y = x W^T + b with W as Q4_1 blocks and x quantized per row to 8-bit blocks of 32 (precision "w4a8"):
    integer dot products, llama.cpp's numerics for Q4_1 weights (lab/engine/native/lowbit_w4a8.cpp states them).
    The op's kernel runs where it is built (AVX-512 VNNI, AVX-VNNI, AVX2 or plain C++, the same bits); without it
    `w4a8_reference` computes the same bits in PyTorch."""

    def __init__(self, groups: Q4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        n, k = groups.q.shape
        packed, scales = pack_w4a8(groups)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = k, n
        self.dtype = dtype
        self._unpacked: tuple | None = None  # (packed, its unpacked weights) for the reference, made on first use

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix [N, K] (d q + m in float32, then the activation dtype)."""
        q, d, m = unpack_w4a8(self.packed, self.scales)
        blocks = q.float().reshape(q.shape[0], -1, GROUP)
        return (d[..., None] * blocks + m[..., None]).reshape(q.shape).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        flat = _activations(x, self.in_features, self.dtype)  # [M, K]
        ops = _lowbit_ops(any_setting=True)
        if ops is not None:
            y = ops.w4a8_mm(flat, buffers["packed"], buffers["scales"])
        else:
            packed = buffers["packed"]
            if self._unpacked is None or self._unpacked[0] is not packed:  # also after `concatenate` swapped it
                self._unpacked = (packed, unpack_w4a8(packed, buffers["scales"]))
            y = w4a8_reference(flat, *self._unpacked[1])
        if buffers["bias"] is not None:
            y = y + buffers["bias"]
        return y.reshape(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class Q8Blocks:
    """ggml's Q8_0 blocks of a weight [N, K]: w = d q with q [N, K] int8 and one scale d per 32 inputs, d [N, K / 32]
    float32 holding fp16 values (block_q8_0 stores d in fp16)."""

    q: torch.Tensor
    d: torch.Tensor


def q8_from_weight(weight: torch.Tensor) -> Q8Blocks:
    """ggml's Q8_0 rule (quantize_row_q8_0_ref): d = max |w| / 127 per block of 32, rounded to fp16, and q =
    round(w / d) with d before that rounding; halves round to even here (ggml's roundf: away from zero)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return Q8Blocks(q, d.to(torch.float16).float())


def q8_from_gguf_blocks(raw: np.ndarray, n: int, k: int) -> Q8Blocks:
    """Q8_0 blocks from a GGUF tensor's raw bytes [N, K / 32 * 34] (per block: fp16 d, then 32 int8 q)."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP, 2 + GROUP)
    d = blocks[..., :2].copy().view(np.float16).reshape(n, k // GROUP)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Q8Blocks(torch.from_numpy(q.copy()), torch.from_numpy(d.astype(np.float32)))


def pack_w8a8(blocks: Q8Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The w8a8 layout (lab/engine/native/lowbit_w8a8.cpp): packed [N / 16, K / 32, 512] uint8 holding q + 128 (per
    tile of 16 columns and block, 8 parts of 64 bytes; byte 4c + i of part p holds input 4p + i of column c) and
    scales [N / 16, K / 32, 16] int16, the bits of the fp16 d."""
    n, k = blocks.q.shape
    tiles, groups = n // A8_TILE, k // GROUP
    q = (blocks.q.to(torch.int16) + 128).to(torch.uint8).reshape(tiles, A8_TILE, groups, 8, 4)  # [t, c, g, p, i]
    packed = q.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8 * 64).contiguous()
    scales = blocks.d.to(torch.float16).reshape(tiles, A8_TILE, groups).permute(0, 2, 1).contiguous()
    return packed, scales.view(torch.int16)


def unpack_w8a8(packed: torch.Tensor, scales: torch.Tensor) -> Q8Blocks:
    """`pack_w8a8` undone."""
    tiles, groups = packed.shape[:2]
    q = packed.reshape(tiles, groups, 8, A8_TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * A8_TILE, groups * GROUP)
    d = scales.view(torch.float16).float().permute(0, 2, 1).reshape(tiles * A8_TILE, groups)
    return Q8Blocks((q.to(torch.int16) - 128).to(torch.int8), d)


def w8a8_reference(x: torch.Tensor, blocks: Q8Blocks) -> torch.Tensor:
    """The w8a8 product in PyTorch, bit for bit the op's (lowbit_w8a8.cpp): x [M, K] times Q8_0 blocks -> [M, N] in
    x's dtype. The block dot products are exact in a float32 matrix product (integers below 2^24); the blocks are
    then added in order, one rounding per operation."""
    xq, dx, _ = quantize_activations(x)  # [M, G, 32], [M, G]
    groups = xq.shape[1]
    weights = blocks.q.float().reshape(blocks.q.shape[0], groups, GROUP).permute(1, 2, 0)  # [G, 32, N]
    dots = torch.bmm(xq.transpose(0, 1), weights).permute(1, 2, 0)  # [M, N, G]
    products = (blocks.d[None] * dx[:, None]) * dots  # (d_w d_x) i
    acc = torch.zeros(x.shape[0], blocks.q.shape[0])
    for g in range(groups):
        acc = acc + products[..., g]
    return acc.to(x.dtype)


class W8A8Linear(nn.Module):
    """y = x W^T + b with W as Q8_0 blocks and x quantized per row to 8-bit blocks of 32: integer dot products,
    llama.cpp's numerics for a Q8_0 tensor (lab/engine/native/lowbit_w8a8.cpp states them); the LM head at precision
    w4a8. The op's kernel runs where it is built (AVX-512 VNNI, AVX-VNNI, AVX2 or plain C++, the same bits); without
    it `w8a8_reference` computes the same bits in PyTorch."""

    def __init__(self, blocks: Q8Blocks, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        n, k = blocks.q.shape
        packed, scales = pack_w8a8(blocks)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.in_features, self.out_features = k, n
        self.dtype = dtype
        self._unpacked: tuple | None = None  # (packed, its blocks) for the reference, made on first use

    @classmethod
    def rows(cls, source: W8A8Linear, index: torch.Tensor) -> W8A8Linear:
        """A linear of the output rows `index` of `source` (the same blocks; a draft head's logits over its draft
        vocabulary from the target's LM head), padded with zero rows to a whole tile and cut back in forward."""
        blocks = unpack_w8a8(source.packed, source.scales)
        index = index.long().to(blocks.q.device)
        count = int(index.numel())
        pad = -count % A8_TILE
        q, d = blocks.q.index_select(0, index), blocks.d.index_select(0, index)
        if pad:
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
        bias = None if source.bias is None else source.bias.index_select(0, index.to(source.bias.device))
        linear = cls(Q8Blocks(q, d), None, source.dtype)
        linear.register_buffer("bias", bias)
        linear.out_features = count
        return linear

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized matrix [N, K] (d q in float32, then the activation dtype)."""
        blocks = unpack_w8a8(self.packed, self.scales)
        q = blocks.q.float().reshape(blocks.q.shape[0], -1, GROUP)
        return (blocks.d[..., None] * q).reshape(blocks.q.shape)[: self.out_features].to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        flat = _activations(x, self.in_features, self.dtype)  # [M, K]
        ops = _lowbit_ops(any_setting=True)
        if ops is not None:
            y = ops.w8a8_mm(flat, buffers["packed"], buffers["scales"])
        else:
            packed = buffers["packed"]
            if self._unpacked is None or self._unpacked[0] is not packed:
                self._unpacked = (packed, unpack_w8a8(packed, buffers["scales"]))
            y = w8a8_reference(flat, self._unpacked[1])
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        if buffers["bias"] is not None:
            y = y + buffers["bias"]
        return y.reshape(*x.shape[:-1], self.out_features)


# the dimension along the output features of each low-bit linear's weight buffers (Int4Linear: packed [N, K / 2],
# scales_and_zeros [K / 32, N, 2]; W4A8Linear: whole tiles of 16 columns, which fits_block_tiles guarantees)
_OUTPUT_DIMS = {
    Int4Linear: {"packed": 0, "scales_and_zeros": 1},
    Int8Linear: {"qweight": 0, "scales": 0},
    W4A8Linear: {"packed": 0, "scales": 0},
}


def concatenate(linears: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the outputs of `linears` (same input size, same type) side by side, or None
    when they cannot be joined (mixed types or biases, float32 or GPU float weights).

    `lab.engine.lean_forward` runs q / k / v and gate / up this way: one kernel call instead of three or two. The
    weights are stacked along the output dimension, and each output column of these kernels is its own dot
    product over the input, so every output equals the separate product's bit for bit (tested on the
    embedded model's shapes and on tiny models). Packed 4-bit parts join only after parts whose output size is
    a multiple of `INT4_PACK_BLOCK`. The float case is restricted to reduced precision on a CPU,
    where that equality was measured; float32 and CUDA keep separate products."""
    kinds = {type(m) for m in linears}
    biases = {m.bias is None for m in linears}
    if len(kinds) != 1 or len(biases) != 1 or len({m.in_features for m in linears}) != 1:
        return None
    first, kind = linears[0], kinds.pop()
    bias = None if first.bias is None else torch.cat([m.bias for m in linears])
    if kind in _OUTPUT_DIMS:
        if kind is Int4Linear and any(m.out_features % INT4_PACK_BLOCK for m in linears[:-1]):
            return None  # a part ending in a partial block of the packed layout would shift the next part
        joined = copy.copy(first)  # module attributes shared; buffers replaced below
        dims = _OUTPUT_DIMS[kind].items()
        joined._buffers = {name: torch.cat([m._buffers[name] for m in linears], dim) for name, dim in dims}
        joined._buffers["bias"] = bias
    elif kind is nn.Linear and first.weight.dtype in (torch.bfloat16, torch.float16) and first.weight.is_cpu:
        joined = copy.copy(first)
        weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
        joined._parameters = {"weight": weight, "bias": None if bias is None else nn.Parameter(bias, False)}
    else:
        return None
    forward = first.__dict__.get("forward")  # an instance-level forward (lab.engine.invariance's two-row product)
    if forward is not None:
        joined.forward = types.MethodType(forward.__func__, joined)
    joined.out_features = sum(m.out_features for m in linears)
    return joined


class JoinedLinears:
    """Linears that read the same input run as one product (`concatenate`); falls back to the separate products,
    concatenated, when they cannot be joined."""

    def __init__(self, parts: tuple[nn.Module, ...]) -> None:
        self.parts = parts
        self.joined = concatenate(list(parts))
        self.sizes = [part.out_features for part in parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side in one tensor [..., sum of `sizes`]."""
        if self.joined is None:
            return torch.cat([part.forward(x) for part in self.parts], dim=-1)
        return self.joined.forward(x)


def joined_linears(owner: nn.Module, names: tuple[str, ...]) -> JoinedLinears:
    """The `JoinedLinears` of `owner`'s linears `names` (e.g. q / k / v), cached on `owner`, rebuilt when a part
    is replaced."""
    parts = tuple(getattr(owner, name) for name in names)
    key = "_lab_joined_" + "_".join(names)
    cached = owner.__dict__.get(key)
    if cached is None or any(a is not b for a, b in zip(cached.parts, parts, strict=True)):
        cached = owner.__dict__[key] = JoinedLinears(parts)
    return cached


def fits_block_tiles(linear: nn.Linear) -> bool:
    """Whether the block formats take this shape: output columns in whole tiles of 16 (the int4 packing and the
    8-bit-activation kernels) and inputs in whole blocks of 32 (Q4_1 / Q8_0)."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP == 0


def read_gguf_blocks(gguf_path: Path) -> dict[str, tuple[str, np.ndarray, int, int]]:
    """name -> (block type "Q4_1" or "Q8_0", raw bytes, N, K) for every tensor of a GGUF file stored in those blocks
    (read by the `gguf` package)."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_path))
    out = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            k, n = (int(v) for v in tensor.shape)  # GGUF lists the contiguous (input) dimension first
            out[tensor.name] = (tensor.tensor_type.name, np.asarray(tensor.data), n, k)
    return out


def _gguf_groups(blocks: dict, layer: int, name: str, config) -> Q4Groups | None:
    key = f"blk.{layer}.{GGUF_NAMES[name]}.weight"
    if key not in blocks or blocks[key][0] != "Q4_1":
        return None
    _, raw, n, k = blocks[key]
    groups = q4_from_gguf_blocks(raw, n, k)
    if name == "q_proj":
        return permute_rows_like_hf(groups, int(config.num_attention_heads))
    if name == "k_proj":
        return permute_rows_like_hf(groups, int(config.num_key_value_heads))
    return groups


FOUR_BIT = {"int4": Int4Linear, "w4a8": W4A8Linear}  # the precisions of Q4_1 weights, by their linear


def _replacement(linear: nn.Linear, precision: str, dtype: torch.dtype, groups: Q4Groups | None) -> nn.Module:
    if precision in FOUR_BIT and fits_block_tiles(linear):
        if groups is None or tuple(groups.q.shape) != tuple(linear.weight.shape):
            groups = q4_from_weight(linear.weight)
        return FOUR_BIT[precision](groups, linear.bias, dtype)
    return Int8Linear(linear.weight, linear.bias, dtype)


def quantized_linear(linear: nn.Linear, precision: str, dtype: torch.dtype) -> nn.Module:
    """`linear` in its low-bit form at `precision` (int4 / w4a8 blocks where the shape allows, else int8; activations
    in `dtype`)."""
    if precision not in ("int8", *FOUR_BIT):
        raise ValueError(f"{precision!r} is not a low-bit precision; choose int8, {', '.join(FOUR_BIT)}")
    return _replacement(linear, precision, dtype, None)


def quantize_linears(module: nn.Module, precision: str, dtype: torch.dtype) -> int:
    """Replace every `nn.Linear` inside `module` (at any depth) by its low-bit form at `precision` (int4 where the
    shape allows, else int8; activations in `dtype`); returns how many were replaced (none for bf16)."""
    if precision not in ("int8", *FOUR_BIT):
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, quantized_linear(child, precision, dtype))
                replaced += 1
    return replaced


def quantize_model(
    model: nn.Module, precision: str, dtype: torch.dtype, gguf_path: Path | None = None
) -> dict[str, int]:
    """Replace the decoder layers' linears and the LM head in place; returns how many modules took each format.
    `dtype` is the activation dtype the kernels run in (the model's dtype after loading)."""
    if precision == "bf16":
        return {}
    if precision not in ("int8", *FOUR_BIT):
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    blocks = read_gguf_blocks(gguf_path) if gguf_path is not None and precision in FOUR_BIT else {}
    counts: dict[str, int] = {}
    for index, layer in enumerate(model.get_decoder().layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in LAYER_LINEARS:
                linear = getattr(parent, name, None)
                if isinstance(linear, nn.Linear):
                    groups = _gguf_groups(blocks, index, name, model.config) if blocks else None
                    new = _replacement(linear, precision, dtype, groups)
                    setattr(parent, name, new)
                    kind = type(new).__name__
                    counts[kind] = counts.get(kind, 0) + 1
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        new_head = _head_replacement(head, precision, dtype, blocks, tied)
        model.set_output_embeddings(new_head)  # the input embedding keeps its own float weight
        counts[f"{type(new_head).__name__} head"] = 1
    return counts


def _head_replacement(head: nn.Linear, precision: str, dtype: torch.dtype, blocks: dict, tied: bool) -> nn.Module:
    """The LM head at `precision`: w4a8 takes Q8_0 blocks (the GGUF's own, `output.weight`, or `token_embd.weight`
    when the model ties them; else quantized from the float weight), times 8-bit activation blocks; the other
    low-bit precisions, and shapes the w8a8 layout does not take, int8 per channel."""
    if precision == "w4a8" and fits_block_tiles(head):
        for name in ("output.weight", "token_embd.weight") if tied else ("output.weight",):
            kind, raw, n, k = blocks.get(name, ("", None, 0, 0))
            if kind == "Q8_0" and (n, k) == tuple(head.weight.shape):
                return W8A8Linear(q8_from_gguf_blocks(raw, n, k), head.bias, dtype)
        return W8A8Linear(q8_from_weight(head.weight), head.bias, dtype)
    return Int8Linear(head.weight, head.bias, dtype)


def quantized_head(head: nn.Linear, precision: str, dtype: torch.dtype) -> nn.Module:
    """A draft head's own output layer in the target's LM-head format at `precision` (Q8_0 blocks at w4a8, where the
    shape fits, else int8 per channel), quantized from its float weight."""
    return _head_replacement(head, precision, dtype, {}, tied=False)


def precision_of(model: nn.Module) -> str:
    """w4a8 / int4 / int8 when the model holds such modules, else bf16 (its float weights)."""
    kinds = {type(m) for m in model.modules()}
    for precision, linear in FOUR_BIT.items():
        if linear in kinds:
            return precision
    return "int8" if Int8Linear in kinds else "bf16"


def resolve_precision(precision: str, device: torch.device, dtype: torch.dtype) -> str:
    """The precision a model in `dtype` on `device` gets (`lab.engine.defaults.choose` with that dtype given):
    bf16 (float weights) on CUDA / MPS; on CPU "auto" is w4a8 (int4 until the op is built) where the dtype is the
    low-bit kernels' bfloat16 and the kernels are vectorized, else float weights. ValueError for unknown names or
    low bits on a GPU."""
    from lab.engine.defaults import NAMES, choose  # defaults reads PRECISIONS from here

    return choose(device, NAMES.get(dtype, str(dtype)), precision).precision


def quantized_copy(loaded, precision: str):
    """A LoadedModel whose model is a deep copy of `loaded.model` quantized to `precision` from its current
    float weights (tests quantize tiny random models this way; `lab.engine.models` quantizes at load time)."""
    model = copy.deepcopy(loaded.model)
    quantize_model(model, precision, loaded.dtype)
    return dataclasses.replace(loaded, model=model.eval(), precision=precision)
