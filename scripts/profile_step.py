"""Where the time of one decode step and one tree-verify step goes, per weight precision (issue 17).

For each precision: the median wall time of a bare `lab.engine.runtime.decode_step` (one token after a prompt) and of a
`lab.engine.runtime.verify_tree` over a --nodes-node tree under `rows_invariant`, as the verifier runs it (cache
cropped back after each), then one torch.profiler pass over the same calls that splits the time into matmul
kernels (`aten::mm` / `addmm` and the low-bit `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`),
attention (`scaled_dot_product_attention`, or the float64 ops of `lab.engine.invariance.exact_attention`), the other
ATen ops (norms, rotary, cache concatenation, elementwise) and the rest: Python and module dispatch, i.e. wall
time no ATen op accounts for. Finally the per-token wall time of the greedy strategy itself (the step plus
logits processing, the top-5 alternatives shown in the UI and detokenization). Timings are noisy on a shared
machine: run it alone. With the C++ decoder layers (`lab.engine.native_forward`) the attention loop runs inside
`decoding_lab::decoder_layers`, whose self time (that loop and the op's own bookkeeping) counts as attention.

`--compare-native` instead times the decode step and the tree verify with the C++ layers on and off
(`DECODING_LAB_NATIVE_FORWARD`), interleaved in rounds in one process, so the machine's drift hits both alike,
and checks that both give the same logits. `--compare-lowbit` times the decode step and chain verifies of 4, 8
and 16 rows with ATen's low-bit kernels and with the op's row-efficient ones (lab/engine/native/lowbit_mm.h),
interleaved the same way. `--batched-steps 1,4,8,16` times one batched decode step (`lab.engine.runtime.decode_steps`,
B sequences with their own caches in one forward, as `lab distill` runs them) per B, interleaved the same way.

`--compare-build REV` times the decode step and chain verifies of 4, 8 and 16 rows with the op of git revision REV
(its lab/engine/native sources, built into a temporary folder under another op namespace) and with this checkout's,
interleaved the same way: the before / after of a change to the op in one process (the LM head's low-bit product
is swapped too; the Python around the op is this checkout's in both).

`--loop step|verify` only runs that call --steps times after a warm-up (the first precision), for a sampling
profiler outside Python, which sees the C++ frames torch.profiler cannot split (the op's attention, its kernels,
libgomp's waits; --delay skips the model's loading):

    perf record -F 1999 --delay 15000 -o /tmp/v.data -- \
        python scripts/profile_step.py --precisions int4 --loop verify --steps 700
    perf report -i /tmp/v.data --stdio --no-children --sort dso,symbol --percent-limit 0.5

usage: python scripts/profile_step.py [--precisions bf16,int8,int4] [--steps 40] [--nodes 16] [--context N]
       [--compare-native] [--compare-lowbit] [--compare-build REV] [--batched-steps 1,4,8,16] [--loop step|verify]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.cpp_extension import load

from lab.engine import native_forward, runtime
from lab.engine.invariance import rows_invariant
from lab.engine.models import LoadedModel, load_model
from lab.engine.quant import set_lowbit_kernels
from lab.engine.tree_attention import TreeAttention, build_tree_attention
from lab.params import build_params
from lab.trace import summarize
from strategies import collect, get_strategy

MATMUL = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")
# SDPA (prefill, batched forwards) and `lab.engine.invariance.exact_attention`'s float64 ops (decode steps and verify
# forwards of row-invariant models); aten::bmm also holds the rotary embedding's tiny product
ATTENTION = ("aten::scaled_dot_product_attention", "aten::bmm", "aten::_softmax", "aten::masked_fill_")
NATIVE = "decoding_lab::decoder_layers"  # its self time: the C++ attention loop and the op's bookkeeping
PROMPT = "Explain in two sentences why the sky is blue, then give one everyday example of scattering."


def chain_tree(nodes: int) -> TreeAttention:
    """A tree of `nodes` nodes: two branches from the root, each a chain (a typical EAGLE / Medusa shape)."""
    parents = [-1] + [0 if i <= 2 else i - 2 for i in range(1, nodes)]
    return build_tree_attention(parents)


CONTEXT = 0  # --context: cached positions before each call (0: the prompt's own length)


def step_calls(loaded: LoadedModel, nodes: int):
    """(decode-step fn, verify-tree fn) on a prefilled cache of the prompt (repeated up to CONTEXT tokens when that
    is set); each restores the cache length."""
    ids = loaded.encode(PROMPT)
    if CONTEXT:
        ids = (ids * (CONTEXT // len(ids) + 1))[:CONTEXT]
    state, _ = runtime.prefill(loaded, ids)
    tree = chain_tree(nodes)
    drafted = [ids[-1]] * nodes
    length = state.length

    def decode() -> None:
        runtime.decode_step(state, ids[-1])
        runtime.crop(state, length)

    def verify() -> None:
        with rows_invariant(loaded):  # as lab.speculative.verify runs it
            runtime.verify_tree(state, tree, drafted)
        runtime.crop(state, length)

    return decode, verify


def median_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def split(fn, steps: int) -> dict[str, float]:
    """Shares of profiled wall time: matmul, attention, other ATen ops, rest (Python and dispatch)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = time.perf_counter() - start
    totals = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        if event.key in MATMUL:
            totals["matmul"] += event.self_cpu_time_total
        elif event.key in ATTENTION or event.key == NATIVE or "flash_attention" in event.key:
            totals["attention"] += event.self_cpu_time_total
        elif event.key.startswith("aten::"):
            totals["other ops"] += event.self_cpu_time_total
    ops = {k: v / 1e6 / wall for k, v in totals.items()}
    ops["rest"] = max(0.0, 1 - sum(ops.values()))
    return ops


def greedy_ms_per_token(loaded: LoadedModel, tokens: int) -> float:
    strategy = get_strategy("greedy")
    params = build_params(strategy.Params, {"max_new_tokens": tokens})
    ids = loaded.encode(PROMPT)
    collect(strategy.run(loaded, ids, params, torch.Generator()))  # warm-up
    stats = summarize(collect(strategy.run(loaded, ids, params, torch.Generator())))
    return 1000 * stats.wall_s / max(stats.new_tokens, 1)


def compare_native(loaded: LoadedModel, nodes: int, steps: int, rounds: int = 8) -> list[str]:
    """Table rows: median ms with the C++ layers off and on, interleaved in `rounds` rounds of `steps` calls."""
    lines = []
    for label, fn in zip(("decode step", f"verify {nodes}-node tree"), step_calls(loaded, nodes), strict=True):
        times: dict[str, list[float]] = {"0": [], "1": []}
        for index in range(rounds):
            for switch in ("0", "1") if index % 2 == 0 else ("1", "0"):
                os.environ[native_forward.SWITCH] = switch
                times[switch].append(median_ms(fn, steps))
        off, on = statistics.median(times["0"]), statistics.median(times["1"])
        lines.append(f"| {loaded.precision} | {label} | {off:.2f} | {on:.2f} | {off / on:.2f}x |")
    os.environ.pop(native_forward.SWITCH, None)
    return lines


def before_after(loaded: LoadedModel, settings, steps: int, rounds: int = 6) -> list[str]:
    """Table rows: the decode step and chain verifies of 4, 8 and 16 rows under the two `settings` (callables that
    set up "before" and "after", the second left in place at the end), interleaved in `rounds` rounds of `steps`
    calls; each call's median ms under both, each verify also as a multiple of the decode step of its setting."""
    calls = {"decode step": step_calls(loaded, 1)[0]}
    calls |= {f"verify {rows}-node tree": step_calls(loaded, rows)[1] for rows in (4, 8, 16)}
    times: dict[tuple[str, int], list[float]] = {}
    for index in range(rounds):
        for setting in (0, 1) if index % 2 == 0 else (1, 0):
            settings[setting]()
            for label, fn in calls.items():
                times.setdefault((label, setting), []).append(median_ms(fn, steps))
    settings[1]()
    ms = {key: statistics.median(values) for key, values in times.items()}
    lines = []
    for label in calls:
        before, after = ms[(label, 0)], ms[(label, 1)]
        step_before, step_after = ms[("decode step", 0)], ms[("decode step", 1)]
        lines.append(
            f"| {loaded.precision} | {label} | {before:.2f} ({before / step_before:.2f}x step) | "
            f"{after:.2f} ({after / step_after:.2f}x step) | {before / after:.2f}x |"
        )
    return lines


def compare_lowbit(loaded: LoadedModel, steps: int) -> list[str]:
    """`before_after` with ATen's low-bit kernels and with the op's row-efficient ones
    (`lab.engine.quant.set_lowbit_kernels`)."""
    return before_after(loaded, (lambda: set_lowbit_kernels(False), lambda: set_lowbit_kernels(True)), steps)


SWAPPED_OPS = ("decoder_layers", "w4a8_mm", "w8a8_mm", "int4_mm", "int8_mm")  # what a forward calls


@cache
def reference_ops(revision: str) -> dict[str, object]:
    """The ops of SWAPPED_OPS as git revision `revision` builds them (its lab/engine/native sources compiled with this
    checkout's flags into a temporary folder, under the namespace decoding_lab_ref; once per process)."""
    root = Path(__file__).resolve().parents[1]
    folder = "lab/engine/native"
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{revision}:{folder}"],
                           check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="profile-step-ref-"))
    for name in names:
        text = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{folder}/{name}"],
                              check=True, capture_output=True, text=True).stdout  # fmt: skip
        text = text.replace("TORCH_LIBRARY(decoding_lab,", "TORCH_LIBRARY(decoding_lab_ref,")
        (work / name).write_text(
            text.replace("TORCH_LIBRARY_FRAGMENT(decoding_lab,", "TORCH_LIBRARY_FRAGMENT(decoding_lab_ref,")
        )
    (work / "build").mkdir()
    sources = [str(work / name) for name in names if name.endswith(".cpp")]
    load("decoding_lab_ref", sources, extra_cflags=native_forward.compile_flags(), extra_ldflags=["-fopenmp"],
         build_directory=str(work / "build"), is_python_module=False)  # fmt: skip
    return {name: getattr(torch.ops.decoding_lab_ref, name) for name in SWAPPED_OPS}


def compare_build(loaded: LoadedModel, revision: str, steps: int) -> list[str]:
    """`before_after` with the op of `revision` and with this checkout's."""
    assert native_forward.build(), "the op is not built here"
    reference = reference_ops(revision)
    current = {name: getattr(torch.ops.decoding_lab, name) for name in SWAPPED_OPS}

    def use(ops: dict) -> None:
        for name, op in ops.items():
            setattr(torch.ops.decoding_lab, name, op)

    try:
        return before_after(loaded, (lambda: use(reference), lambda: use(current)), steps)
    finally:
        use(current)


def batched_steps(loaded: LoadedModel, widths: list[int], steps: int, rounds: int = 4) -> list[str]:
    """Table rows: one `runtime.decode_steps` call over B sequences (the B = 1 row: a plain decode step), median ms,
    its multiple of the B = 1 time and the tokens/s it makes, the widths interleaved in `rounds` rounds of `steps`
    calls; each sequence is PROMPT with a different number of leading spaces, cropped back after each call."""
    prompt = loaded.encode(PROMPT)
    calls = {}
    for width in widths:
        states = [runtime.prefill(loaded, prompt[:1] * (b % 7) + prompt)[0] for b in range(width)]
        lengths = [state.length for state in states]

        def call(states=states, lengths=lengths) -> None:
            if len(states) == 1:
                runtime.decode_step(states[0], prompt[-1])
            else:
                runtime.decode_steps(states, [prompt[-1]] * len(states))
            for state, length in zip(states, lengths, strict=True):
                runtime.crop(state, length)

        calls[width] = call
    times: dict[int, list[float]] = {width: [] for width in widths}
    for index in range(rounds):
        for width in widths if index % 2 == 0 else widths[::-1]:
            times[width].append(median_ms(calls[width], steps))
    ms = {width: statistics.median(values) for width, values in times.items()}
    base = ms[widths[0]]
    return [
        f"| {loaded.precision} | {w} | {ms[w]:.2f} | {ms[w] / base:.2f}x | {1000 * w / ms[w]:.0f} |" for w in widths
    ]


def same_logits(loaded: LoadedModel) -> bool:
    """A few greedy steps with the C++ layers off and on give the same logits (bit for bit)."""
    outputs = []
    for switch in ("0", "1"):
        os.environ[native_forward.SWITCH] = switch
        state, out = runtime.prefill(loaded, loaded.encode(PROMPT))
        logits = [out.logits[-1]]
        for _ in range(8):
            out = runtime.decode_step(state, int(logits[-1].argmax()))
            logits.append(out.logits[-1])
        outputs.append(torch.stack(logits))
    os.environ.pop(native_forward.SWITCH, None)
    return torch.equal(*outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", default="bf16,int8,int4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--compare-native", action="store_true", help="C++ layers off / on, interleaved")
    parser.add_argument("--compare-lowbit", action="store_true", help="ATen's / the op's low-bit kernels, interleaved")
    parser.add_argument("--compare-build", metavar="REV", help="the op of git revision REV / this one's, interleaved")
    parser.add_argument("--batched-steps", default=None, help="e.g. 1,4,8,16,32: decode_steps over B sequences")
    parser.add_argument("--loop", choices=("step", "verify"), help="only run this call --steps times (for perf)")
    parser.add_argument("--context", type=int, default=0, help="cached positions before a call (default: the prompt)")
    args = parser.parse_args()
    global CONTEXT
    CONTEXT = args.context
    native = native_forward.enabled()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, C++ layers {native}\n")
    if args.loop:
        loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=args.precisions.split(",")[0])
        with torch.inference_mode():
            decode, verify = step_calls(loaded, args.nodes)
            fn = decode if args.loop == "step" else verify
            print(f"{loaded.precision} {args.loop}: median {median_ms(fn, args.steps):.2f} ms over {args.steps} calls")
        return
    if args.batched_steps:
        lines = ["| precision | sequences B | median ms | x B = 1 | tokens/s |", "|---|---|---|---|---|"]
        for precision in args.precisions.split(","):
            loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
            with torch.inference_mode():
                lines += batched_steps(loaded, [int(w) for w in args.batched_steps.split(",")], args.steps)
        print("\n".join(lines))
        return
    if args.compare_build:
        lines = [
            f"| precision | call | op of {args.compare_build}: median ms | this op | speedup |",
            "|---|---|---|---|---|",
        ]
        for precision in args.precisions.split(","):
            loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
            with torch.inference_mode():
                lines += compare_build(loaded, args.compare_build, args.steps)
        print("\n".join(lines))
        return
    if args.compare_lowbit:
        lines = [
            "| precision | call | ATen's kernels: median ms | the op's kernels | speedup |",
            "|---|---|---|---|---|",
        ]
        for precision in args.precisions.split(","):
            loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
            with torch.inference_mode():
                lines += compare_lowbit(loaded, args.steps)
        print("\n".join(lines))
        return
    if args.compare_native:
        lines = ["| precision | call | C++ layers off: median ms | on: median ms | speedup |", "|---|---|---|---|---|"]
        for precision in args.precisions.split(","):
            loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
            with torch.inference_mode():
                lines += compare_native(loaded, args.nodes, args.steps)
                print(f"{precision}: same logits with and without: {same_logits(loaded)}")
        print("\n".join(lines))
        return
    header = "| precision | call | median ms | matmul | attention | other ATen ops | rest (Python, dispatch) |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    greedy_lines = []
    for precision in args.precisions.split(","):
        loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
        with torch.inference_mode():
            labels = ("decode step", f"verify {args.nodes}-node tree")
            for label, fn in zip(labels, step_calls(loaded, args.nodes), strict=True):
                ms = median_ms(fn, args.steps)
                shares = split(fn, max(10, args.steps // 2))
                cells = " | ".join(f"{100 * shares[k]:.0f}%" for k in ("matmul", "attention", "other ops", "rest"))
                lines.append(f"| {precision} | {label} | {ms:.2f} | {cells} |")
        greedy_lines.append(f"| {precision} | {greedy_ms_per_token(loaded, 64):.2f} |")
        del loaded
    print("\n".join(lines))
    print("\n| precision | greedy strategy ms / token (64 tokens, prefill included) |\n|---|---|")
    print("\n".join(greedy_lines))


if __name__ == "__main__":
    main()
