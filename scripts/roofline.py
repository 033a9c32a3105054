"""Roofline of the CPU matmul kernels on the embedded model's shapes (issue 17).

Measures the machine's read bandwidth (a sum over a large tensor, bytes read / time) and, for each linear
shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, the 49152x576 LM head) and
each batch of rows, the time of: bf16 and fp32 `F.linear`, `torch._weight_int8pack_mm` (int8 per output
channel, bf16 activations) and `torch._weight_int4pack_mm_for_cpu` (4-bit groups, bf16 and fp32 activations).
Effective GB/s = bytes of the weight operand (values plus scales) / time. Each kernel cycles through enough
copies of its weight to exceed the last-level cache, as a decode step does when it streams every layer once.
Timings are noisy on a shared machine: run it alone and read the table as an estimate.

usage: python scripts/roofline.py [--rows 1,8,16] [--repeats 5] [--shapes q/o,head] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576)}
SHAPES |= {"down 576x1536": (576, 1536), "lm head 49152x576": (49152, 576)}
WORKING_SET = 96 * 2**20  # bytes of weight copies cycled per kernel: about three times the L3 of this machine
GROUP = 32  # the GGUF Q4_1 block length


def best_seconds(fn: Callable[[int], object], calls: int, repeats: int, budget_s: float = 4.0) -> float:
    """Best-of-`repeats` mean seconds per call of fn(i), i cycling over the copies (fewer repeats once a
    measurement has used `budget_s`: slow kernels would otherwise take minutes on a busy machine)."""
    fn(0)
    best, begin = float("inf"), time.perf_counter()
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, (time.perf_counter() - start) / calls)
        if time.perf_counter() - begin > budget_s:
            break
    return best


def read_bandwidth(repeats: int) -> dict[str, float]:
    """GB/s of a full read: x.sum() over a 256 MiB tensor, bf16 and fp32 (the issue's reference measurement)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.ones(256 * 2**20 // dtype.itemsize, dtype=dtype)
        seconds = best_seconds(lambda i, x=x: x.sum(), 3, repeats)
        out[str(dtype).removeprefix("torch.")] = x.numel() * dtype.itemsize / seconds / 1e9
    return out


def int4_pack(weight: torch.Tensor, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along K (Q4_1's w = d q + m) in the layout of `_weight_int4pack_mm_for_cpu`."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-8)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(act_dtype)  # [K/g, N, 2]
    return packed, scales_and_zeros


def measure_shape(n: int, k: int, rows: list[int], repeats: int) -> list[dict]:
    """One result per kernel and row count for an [n, k] weight (y = x W^T)."""
    base = torch.randn(n, k) * 0.02
    packed, sz = int4_pack(base, torch.bfloat16)
    _, sz32 = int4_pack(base, torch.float32)
    scale8 = base.abs().amax(1) / 127
    w8 = (base / scale8[:, None]).round().clamp(-127, 127).to(torch.int8)
    operands = {
        "bf16 linear": ((base.bfloat16(),), torch.bfloat16),
        "fp32 linear": ((base,), torch.float32),
        "int8pack_mm (bf16 x)": ((w8, scale8.bfloat16()), torch.bfloat16),
        "int4pack_mm g32 (bf16 x)": ((packed, sz), torch.bfloat16),
        "int4pack_mm g32 (fp32 x)": ((packed, sz32), torch.float32),
    }
    calls = {
        "bf16 linear": lambda x, w: F.linear(x, w[0]),
        "fp32 linear": lambda x, w: F.linear(x, w[0]),
        "int8pack_mm (bf16 x)": lambda x, w: torch._weight_int8pack_mm(x, w[0], w[1]),
        "int4pack_mm g32 (bf16 x)": lambda x, w: torch._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1]),
        "int4pack_mm g32 (fp32 x)": lambda x, w: torch._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1]),
    }
    results = []
    for name, (tensors, act_dtype) in operands.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        copies = max(1, WORKING_SET // nbytes)
        pool = [tuple(t.clone() for t in tensors) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).to(act_dtype)

            def one(i: int, x=x, call=calls[name], pool=pool, copies=copies) -> object:
                return call(x, pool[i % copies])

            seconds = best_seconds(one, min(max(copies, 20), 300), repeats)
            row = {"kernel": name, "n": n, "k": k, "rows": m, "us": seconds * 1e6, "MB": nbytes / 1e6}
            results.append(row | {"GB/s": nbytes / seconds / 1e9})
            print(f"{name} {n}x{k} rows={m}: {seconds * 1e6:.0f} us, {nbytes / seconds / 1e9:.1f} GB/s", flush=True)
    return results


def format_table(bandwidth: dict[str, float], results: list[dict], rows: list[int]) -> str:
    lines = ["read bandwidth (sum over 256 MiB): " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bandwidth.items())]
    lines += ["", "| shape | kernel | MB | " + " | ".join(f"M={m} us (GB/s)" for m in rows) + " |"]
    lines.append("|---|---|---|" + "---|" * len(rows))
    keyed = {(r["n"], r["k"], r["kernel"], r["rows"]): r for r in results}
    for label, (n, k) in SHAPES.items():
        for kernel in dict.fromkeys(r["kernel"] for r in results):
            if (n, k, kernel, rows[0]) not in keyed:
                continue
            cells = [f"{keyed[n, k, kernel, m]['us']:.0f} ({keyed[n, k, kernel, m]['GB/s']:.1f})" for m in rows]
            size = keyed[n, k, kernel, rows[0]]["MB"]
            lines.append(f"| {label} | {kernel} | {size:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="", help="comma-separated substrings of shape labels (default all)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    with torch.inference_mode():
        bandwidth = read_bandwidth(args.repeats)
        results = []
        for label, (n, k) in SHAPES.items():
            if args.shapes and not any(s in label for s in args.shapes.split(",")):
                continue
            results += measure_shape(n, k, rows, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table(bandwidth, results, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
