"""The dtype and weight precision a model loads in when either is "auto", chosen together (issue 28).

The low-bit linears (`lab.engine.quant`) have two kinds of CPU kernel. Weight-only int4 / int8 run PyTorch's kernels
(or the op's row-efficient copies of them), whose vectorized code (AVX2 and AVX-512 builds) takes bfloat16
activations: the kernel widens them to float32 itself, so it needs no bf16 instructions, while float32 activations
take a scalar loop many times slower. w4a8 quantizes each activation row to 8-bit blocks and multiplies with integer
dot products (llama.cpp's numerics for the same Q4_1 weights): it runs in the C++ op only (AVX-512 VNNI, AVX-VNNI or
AVX2 variants; `w4a8_reference` in PyTorch is a correctness fallback, not a fast path); it costs less than int4 per
row and agrees with the float model about as well (both measured in docs/benchmarks.md). So a low-bit precision is
always paired with bfloat16 activations, and "auto" goes low-bit on any CPU where a vectorized kernel exists,
whether or not the CPU multiplies bf16 matrices fast. The rules, on CPU (`choose`):
- dtype and precision both given: as requested (the reason warns when a low-bit precision runs on fp32 or fp16).
- precision int4 / int8 / w4a8, dtype auto: bfloat16.
- both auto, where the CPU capability is AVX2 or AVX-512 (`CpuFeatures`): w4a8 with bfloat16 when the op's integer
  products are built (`CpuFeatures.integer_products`), else int4 with bfloat16; other CPUs keep float weights.
- dtype auto with float weights (precision bf16, or auto without a vectorized low-bit kernel): bfloat16 on CPUs
  with native bf16 dot products (cpuid flags avx512_bf16 or amx_bf16); elsewhere the faster of float32 and
  bfloat16 by timing a real decode step of the loaded model in both (`decode_step_seconds`: CPU time, the minimum
  over interleaved repeats, so a busy machine slows both alike and a stall on one repeat does not decide), with
  bfloat16 only where it is markedly faster.
- dtype given, precision auto: as both auto with bfloat16; float weights with other dtypes.
Whether the op is built is asked without waiting for a compiler (`integer_products_ready`): a cached build loads
(about a second); with none the op starts building in the background and this process's "auto" takes int4 (a
later process finds the build). CUDA takes bfloat16 and MPS float16, both with float weights. Every choice carries
its reason (`Choice.describe`), which the model records (`LoadedModel.choice`) for traces, the app and bench rows.
Not covered: ARM CPUs (their low-bit kernels are not considered: float weights), per-layer choices, fp16 timing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from lab.engine.quant import PRECISIONS

LOW_BIT = ("int4", "int8", "w4a8")
FLOAT_WEIGHTS = "bf16"  # the precision name of float weights (kept in the model's dtype)
LOW_BIT_ACTIVATIONS = torch.bfloat16  # the activation dtype the vectorized low-bit kernels take
VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() with those kernels
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags: bf16 dot products in hardware
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
BF16_MARGIN = 0.8  # float weights take bf16 activations only when a step costs under 0.8 of the fp32 one
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

Candidate = tuple[torch.dtype, str]  # (activation dtype, precision)
StepTimer = Callable[[list[Candidate]], dict[Candidate, float]]  # seconds of one decode step per candidate


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU offers the kernels: torch's dispatch capability and the cpuid flags of /proc/cpuinfo."""

    capability: str
    flags: frozenset[str]
    integer_products: bool = False  # the op's w4a8 products are loaded (lab.engine.native_forward)

    @property
    def low_bit_vectorized(self) -> bool:
        return self.capability in VECTOR_CAPABILITIES

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & set(NATIVE_BF16_FLAGS))

    def summary(self) -> str:
        flags = [flag for flag in REPORTED_FLAGS if flag in self.flags]
        return self.capability + (f": {', '.join(flags)}" if flags else "")


@dataclass(frozen=True)
class Choice:
    """The dtype and precision a model loads in, and why."""

    dtype: torch.dtype
    precision: str
    reason: str

    def describe(self) -> str:
        weights = "float" if self.precision == FLOAT_WEIGHTS else self.precision
        return f"{NAMES.get(self.dtype, str(self.dtype))} activations, {weights} weights: {self.reason}"


def cpu_features() -> CpuFeatures:
    """This machine's CPU features and whether the op's integer products can run now."""
    return dataclasses.replace(_cpu(), integer_products=integer_products_ready())


def integer_products_ready() -> bool:
    """Whether the op (with its w4a8 products) is loaded, loading a cached build when there is one; never waits for
    a compile from scratch: without a cached build the op starts building in the background (False until then)."""
    from lab.engine import native_forward

    state = native_forward.build_state()
    if state in ("built", "failed"):
        return state == "built"
    if native_forward.cached_build_exists():
        return native_forward.build()
    native_forward.available()  # starts the background build
    return False


@cache
def _cpu() -> CpuFeatures:
    """This machine's CPU features (no flags where /proc/cpuinfo is not readable, e.g. on macOS)."""
    flags: frozenset[str] = frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.partition(":")[2].split())
                break
    except OSError:
        pass
    return CpuFeatures(torch.backends.cpu.get_cpu_capability(), flags)


def parse_dtype(dtype: str) -> torch.dtype | None:
    """None for "auto", else the torch dtype; ValueError naming the choices."""
    if dtype == "auto":
        return None
    by_name = {name: value for value, name in NAMES.items()}
    if dtype not in by_name:
        raise ValueError(f"Unknown dtype {dtype!r}; choose auto, {', '.join(by_name)}.")
    return by_name[dtype]


def choose(
    device: torch.device,
    dtype: str,
    precision: str,
    features: CpuFeatures | None = None,
    time_steps: StepTimer | None = None,
) -> Choice:
    """The (dtype, precision) to load in, by the rules above; `time_steps` times decode steps where the CPU
    features leave the float dtype open (without it, float32 there). ValueError on an unknown name."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    wanted = parse_dtype(dtype)
    if device.type != "cpu":
        if precision in LOW_BIT:
            raise ValueError(f"Precision {precision!r} runs on CPU kernels only; use bf16 on {device.type}.")
        fallback = torch.bfloat16 if device.type == "cuda" else torch.float16
        reason = "as requested" if wanted else f"the {device.type.upper()} default"
        return Choice(wanted or fallback, FLOAT_WEIGHTS, reason)
    return _choose_cpu(wanted, precision, features or cpu_features(), time_steps)


def _choose_cpu(wanted: torch.dtype | None, precision: str, cpu: CpuFeatures, time_steps: StepTimer | None) -> Choice:
    if cpu.low_bit_vectorized:
        kernel = f"the low-bit kernels are vectorized for bfloat16 activations on {cpu.capability} (scalar for float32)"
    else:
        kernel = f"this CPU ({cpu.capability}) has no vectorized low-bit kernel"
    if wanted is not None and precision != "auto":
        slow = precision in LOW_BIT and (wanted != LOW_BIT_ACTIVATIONS or not cpu.low_bit_vectorized)
        return Choice(wanted, precision, "as requested" + (f"; slow: {kernel}" if slow else ""))
    if precision in LOW_BIT:
        return Choice(LOW_BIT_ACTIVATIONS, precision, f"{precision} asked for; {kernel}")
    if precision == "auto" and cpu.low_bit_vectorized and wanted in (None, LOW_BIT_ACTIVATIONS):
        if cpu.integer_products:
            why = "the op's integer products (w4a8: 4-bit weights, 8-bit activation blocks) are built"
            return Choice(LOW_BIT_ACTIVATIONS, "w4a8", f"auto: {why} for {cpu.capability}")
        why = "4-bit weights read a quarter of the bytes (w4a8 needs the op's build)"
        return Choice(LOW_BIT_ACTIVATIONS, "int4", f"auto: {kernel}; {why}")
    if wanted is not None:
        return Choice(wanted, FLOAT_WEIGHTS, f"auto: float weights, as {kernel}")
    dtype, why = _float_dtype(cpu, time_steps)
    if precision == "auto":
        return Choice(dtype, FLOAT_WEIGHTS, f"auto: float weights, as {kernel}; {why}")
    return Choice(dtype, FLOAT_WEIGHTS, f"auto dtype: {why}")


def _float_dtype(cpu: CpuFeatures, time_steps: StepTimer | None) -> tuple[torch.dtype, str]:
    """The activation dtype of float weights, and why: by the flags, else by timing a decode step."""
    if cpu.native_bf16:
        return torch.bfloat16, f"bfloat16 as this CPU has native bf16 dot products ({cpu.summary()})"
    if time_steps is None:
        return torch.float32, f"float32 as this CPU has no native bf16 dot products ({cpu.summary()})"
    times = time_steps([(torch.float32, FLOAT_WEIGHTS), (torch.bfloat16, FLOAT_WEIGHTS)])
    fp32, bf16 = times[(torch.float32, FLOAT_WEIGHTS)], times[(torch.bfloat16, FLOAT_WEIGHTS)]
    dtype = torch.bfloat16 if bf16 < BF16_MARGIN * fp32 else torch.float32
    measured = f"a decode step measured {1000 * bf16:.2f} ms in bfloat16 and {1000 * fp32:.2f} ms in float32"
    return dtype, f"{NAMES[dtype]}: {measured} (CPU time, best of interleaved repeats; no native bf16)"


def min_interleaved(
    steps: dict[Hashable, Callable[[], Any]], repeats: int = 7, clock: Callable[[], float] = time.process_time
) -> dict[Hashable, float]:
    """The least `clock` time of each step over `repeats` rounds that run every step once, in turn."""
    best = {key: float("inf") for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            start = clock()
            step()
            best[key] = min(best[key], clock() - start)
    return best


def decode_step_seconds(models: dict[Hashable, Any], repeats: int = 7, context: int = 32) -> dict[Hashable, float]:
    """CPU seconds of one decode step of each LoadedModel after a `context`-token prefill (the lab's own
    forward, `lab.engine.runtime`): two warm-up steps each, then the minimum over interleaved repeats."""
    from lab.engine import runtime

    steps = {}
    for key, loaded in models.items():
        state, _ = runtime.prefill(loaded, [1 + i % 97 for i in range(context)])

        def step(state: runtime.DecodeState = state) -> None:
            runtime.decode_step(state, 7)
            runtime.crop(state, context)  # every repeat decodes at the same position

        for _ in range(2):  # warm-up
            step()
        steps[key] = step
    return min_interleaved(steps, repeats)
