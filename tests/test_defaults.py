"""dtype and precision chosen together (`lab.engine.defaults`): on simulated CPUs (bf16 products that measure slow,
no vectorized low-bit kernel, a machine under load) and through the model cache with real decode steps of a tiny
model. What is checked is the choice, never a speed."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lab.engine import defaults
from lab.engine.defaults import Choice, CpuFeatures, choose, decode_step_seconds, min_interleaved
from lab.engine.models import ModelCache, ModelLoadError
from lab.engine.quant import PRECISIONS, resolve_precision
from lab.trace import Trace, from_json, to_json
from tests.tiny import tiny_loaded_model

CPU = torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32
# the Intel machine of issue 28: AVX-512 with VNNI, bf16 products slow (no avx512_bf16 / AMX reaching torch)
NO_NATIVE_BF16 = CpuFeatures("AVX512", frozenset({"avx2", "avx512f", "avx512_vnni"}))
NATIVE_BF16 = CpuFeatures("AVX512", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}))
LAPTOP_AVX2 = CpuFeatures("AVX2", frozenset({"avx2", "avx_vnni"}))
NO_AVX2 = CpuFeatures("DEFAULT", frozenset())
OP_BUILT = {"integer_products": True}  # the same CPU with the op's w4a8 products loaded


def bf16_slow(candidates):
    """A decode step that measures 8.4 ms in bf16 and 4.5 ms in fp32 (as on that machine)."""
    return {c: 0.0084 if c[0] == BF16 else 0.0045 for c in candidates}


def never(candidates):
    raise AssertionError(f"no decode step should be timed here, got {candidates}")


@pytest.mark.parametrize("cpu", [NO_NATIVE_BF16, NATIVE_BF16, LAPTOP_AVX2], ids=["no-bf16", "bf16", "avx2"])
def test_slow_bf16_products_still_get_low_bits_at_full_speed(cpu: CpuFeatures) -> None:
    """With the op built: w4a8 (integer products); without it: int4 (PyTorch's vectorized kernel). Both with
    bfloat16 activations, whatever the CPU's bf16 products cost."""
    built = dataclasses.replace(cpu, **OP_BUILT)
    for features, expected in ((built, "w4a8"), (cpu, "int4")):
        auto = choose(CPU, "auto", "auto", features, never)
        assert (auto.dtype, auto.precision) == (BF16, expected) and cpu.capability in auto.reason
        assert choose(CPU, "bfloat16", "auto", features, never).precision == expected
        for low_bit in ("int4", "int8", "w4a8"):  # --precision int4 without --dtype: never fp32 activations
            asked = choose(CPU, "auto", low_bit, features, never)
            assert (asked.dtype, asked.precision) == (BF16, low_bit)
    assert "vectorized" in choose(CPU, "auto", "auto", cpu, never).reason
    assert "w4a8" in choose(CPU, "auto", "auto", cpu, never).reason  # says what the op's build would give
    assert choose(CPU, "float32", "auto", built, never).precision == "bf16"  # low bits only with bf16


def test_an_op_built_on_a_cpu_without_vector_kernels_keeps_float_weights() -> None:
    auto = choose(CPU, "auto", "auto", dataclasses.replace(NO_AVX2, **OP_BUILT), bf16_slow)
    assert (auto.dtype, auto.precision) == (FP32, "bf16")


def test_integer_products_ready_loads_a_cached_build_and_never_compiles(monkeypatch) -> None:
    from lab.engine import native_forward

    calls: list[str] = []
    monkeypatch.setattr(native_forward, "build", lambda: calls.append("build") or True)
    monkeypatch.setattr(native_forward, "available", lambda: calls.append("background") or False)
    for state, cached, ready, expected_calls in (
        ("built", False, True, []),
        ("failed", True, False, []),
        ("not tried", True, True, ["build"]),  # a cached build: loaded now
        ("not tried", False, False, ["background"]),  # none: built in the background, int4 meanwhile
        ("building", False, False, ["background"]),
    ):
        calls.clear()
        monkeypatch.setattr(native_forward, "build_state", lambda state=state: state)
        monkeypatch.setattr(native_forward, "cached_build_exists", lambda cached=cached: cached)
        assert defaults.integer_products_ready() is ready and calls == expected_calls, state


def test_float_weights_take_the_dtype_a_decode_step_measures_faster() -> None:
    slow = choose(CPU, "auto", "bf16", NO_NATIVE_BF16, bf16_slow)
    assert (slow.dtype, slow.precision) == (FP32, "bf16") and "8.40 ms in bfloat16 and 4.50 ms" in slow.reason
    fast = choose(CPU, "auto", "bf16", NO_NATIVE_BF16, lambda cs: {c: 0.003 if c[0] == BF16 else 0.0045 for c in cs})
    assert fast.dtype == BF16
    close = choose(CPU, "auto", "bf16", NO_NATIVE_BF16, lambda cs: {c: 0.004 if c[0] == BF16 else 0.0045 for c in cs})
    assert close.dtype == FP32  # bf16 only where markedly faster
    assert choose(CPU, "auto", "bf16", NATIVE_BF16, never).dtype == BF16  # the flags settle it: nothing timed
    assert choose(CPU, "auto", "bf16", NO_NATIVE_BF16).dtype == FP32  # nothing to time with: the safe dtype


def test_without_a_vectorized_low_bit_kernel_auto_keeps_float_weights() -> None:
    auto = choose(CPU, "auto", "auto", NO_AVX2, bf16_slow)
    assert (auto.dtype, auto.precision) == (FP32, "bf16") and "no vectorized low-bit kernel" in auto.reason
    asked = choose(CPU, "auto", "int4", NO_AVX2, never)  # asked for: kept, and the reason says it is slow here
    assert (asked.dtype, asked.precision) == (BF16, "int4") and "no vectorized" in asked.reason


def test_explicit_choices_pass_through_with_a_warning_where_slow() -> None:
    fp32_int4 = choose(CPU, "float32", "int4", NATIVE_BF16, never)
    assert (fp32_int4.dtype, fp32_int4.precision) == (FP32, "int4") and "slow" in fp32_int4.reason
    assert choose(CPU, "bfloat16", "int4", NATIVE_BF16, never).reason == "as requested"
    assert choose(CPU, "float32", "auto", NATIVE_BF16, never).precision == "bf16"  # low bits only with bf16


def test_gpus_and_bad_names() -> None:
    cuda = choose(torch.device("cuda"), "auto", "auto")
    assert (cuda.dtype, cuda.precision) == (BF16, "bf16")
    assert choose(torch.device("mps"), "auto", "auto").dtype == torch.float16
    with pytest.raises(ValueError, match="CPU kernels"):
        choose(torch.device("cuda"), "auto", "int4")
    with pytest.raises(ValueError, match="precision"):
        choose(CPU, "auto", "int3")
    with pytest.raises(ValueError, match="dtype"):
        choose(CPU, "int4", "auto")
    assert resolve_precision("auto", CPU, FP32) == "bf16" and resolve_precision("int8", CPU, FP32) == "int8"


def test_every_description_fits_a_trace() -> None:
    timers = [never, bf16_slow]
    cpus = [NO_NATIVE_BF16, NATIVE_BF16, LAPTOP_AVX2, NO_AVX2, dataclasses.replace(LAPTOP_AVX2, **OP_BUILT)]
    for cpu, dtype, precision in itertools.product(cpus, ("auto", "float32", "bfloat16", "float16"), PRECISIONS):
        choice = choose(CPU, dtype, precision, cpu, timers[1])
        assert isinstance(choice, Choice) and 0 < len(choice.describe()) <= 400
        trace = Trace("greedy", "m", "p", {}, dtype="bfloat16", precision=choice.precision, choice=choice.describe())
        assert from_json(to_json(trace)).choice == choice.describe()


def test_min_over_interleaved_repeats_survives_a_busy_machine() -> None:
    """bf16 really costs 3 ms and fp32 5 ms, but another process steals the core during bf16's first three
    repeats (4x slower): a one-off measurement picks fp32, the minimum over interleaved repeats picks bf16."""
    now = [0.0]
    calls = {"bf16": 0, "fp32": 0}

    def step(name: str, cost: float):
        def run() -> None:
            calls[name] += 1
            now[0] += cost * (4 if name == "bf16" and calls[name] <= 3 else 1)

        return run

    steps = {"bf16": step("bf16", 0.003), "fp32": step("fp32", 0.005)}
    once = min_interleaved(steps, repeats=1, clock=lambda: now[0])
    assert once["bf16"] > once["fp32"]  # what a one-off measurement under load would conclude
    best = min_interleaved(steps, repeats=7, clock=lambda: now[0])
    assert best == pytest.approx({"bf16": 0.003, "fp32": 0.005})
    timer = lambda cs: {c: best["bf16" if c[0] == BF16 else "fp32"] for c in cs}  # noqa: E731
    assert choose(CPU, "auto", "bf16", NO_NATIVE_BF16, timer).dtype == BF16


def test_decode_step_seconds_times_the_models_own_steps(tiny, one_thread) -> None:
    models = {"a": tiny, "b": tiny}
    seconds = decode_step_seconds(models, repeats=2, context=8)
    assert set(seconds) == {"a", "b"} and all(0 <= s < float("inf") for s in seconds.values())


class _TinyCache(ModelCache):
    """The model cache with tiny random models (float weights, in the asked dtype) in place of loading by name."""

    def __init__(self) -> None:
        super().__init__()
        self.built: dict[tuple[torch.dtype, str], object] = {}

    def _load(self, spec, device, dtype, precision):
        if (dtype, precision) not in self.built:
            loaded = tiny_loaded_model(seed=0)
            loaded.model.to(dtype)
            self.built[(dtype, precision)] = dataclasses.replace(loaded, spec=spec, dtype=dtype, precision=precision)
        return self.built[(dtype, precision)]


def test_the_cache_times_real_decode_steps_once_and_records_the_choice(monkeypatch, one_thread) -> None:
    monkeypatch.setattr(defaults, "cpu_features", lambda: NO_NATIVE_BF16)
    cache = _TinyCache()
    loaded = cache.get("tiny", "cpu", "auto", "bf16")  # float weights on a CPU without native bf16: timed
    assert set(cache.built) == {(FP32, "bf16"), (BF16, "bf16")}  # both candidates ran decode steps
    assert "decode step measured" in loaded.choice and loaded.choice.startswith(str(loaded.dtype)[6:])
    cache.built.clear()
    again = cache.get("tiny", "cpu", "auto", "bf16")
    assert again.choice == loaded.choice and set(cache.built) == {(loaded.dtype, "bf16")}  # chosen once
    auto = cache.get("tiny", "cpu", "auto", "auto")
    assert (auto.dtype, auto.precision) == (BF16, "int4") and cache.known_choice("tiny", "cpu", "auto", "auto")
    monkeypatch.setattr(defaults, "cpu_features", lambda: dataclasses.replace(NO_NATIVE_BF16, **OP_BUILT))
    fresh = _TinyCache()
    assert fresh.get("tiny", "cpu", "auto", "auto").precision == "w4a8" and set(fresh.built) == {(BF16, "w4a8")}
    assert cache.known_choice("tiny", "cpu", "float32", "auto") is None  # never asked: nothing chosen
    with pytest.raises(ModelLoadError, match="dtype"):
        cache.get("tiny", "cpu", "int4", "auto")


def test_the_app_records_the_choice_of_a_loaded_request(monkeypatch) -> None:
    from lab.app import runner
    from lab.app.validation import validate_request

    monkeypatch.setattr(defaults, "cpu_features", lambda: NATIVE_BF16)
    monkeypatch.setattr(runner, "MODEL_CACHE", _TinyCache())
    request = validate_request("greedy", "hi", {}, model="tiny", device="cpu")  # dtype and precision auto
    trace = runner.new_trace(request)
    runner.record_choice(trace, request)  # not loaded yet: nothing to record
    assert (trace.dtype, trace.precision, trace.choice) == ("", "", "")
    loaded = runner.MODEL_CACHE.get("tiny", "cpu", "auto", "auto")
    runner.record_choice(trace, request)
    assert (trace.dtype, trace.precision) == ("bfloat16", "int4") and trace.choice == loaded.choice
    assert runner.new_trace(request, loaded).choice == loaded.choice


def test_the_app_records_the_forward_path_its_request_ran_on() -> None:
    """The app makes its trace before the model loads; the path the run was pinned to is filled in at the end."""
    from lab.app import runner
    from lab.app.validation import validate_request
    from lab.engine.forward_path import ForwardPath

    request = validate_request("greedy", "hi", {}, model="tiny", device="cpu")
    other = validate_request("greedy", "another prompt", {}, model="tiny", device="cpu")
    path = ForwardPath("lean", "a tiny Llama", True)
    runner._remember_path(request, path)
    trace, untouched = runner.new_trace(request), runner.new_trace(other)
    runner.record_choice(trace, request)
    runner.record_choice(untouched, other)
    assert trace.forward_path == path.as_dict() and untouched.forward_path is None
