"""`python -m lab doctor`: which forward path runs on this machine, why, and whether the paths agree.

Prints the machine (CPU model, the vector flags the paths care about: AVX2, AVX-512, VNNI, BF16, AMX; the
capability PyTorch dispatches to), the software, whether the C++ decoder layers are built (waiting for the build,
as a run would once it finishes), the model as loaded, the path `lab.engine.forward_path.choose` picks for it and
why, then runs one short input (a prompt, then two one-token steps) through every path that applies to the model
and compares each forward's logits with `model(...)`'s. The contract is bit equality for every pair (lean = model
bit for bit, the op = the lean loop bit for bit): a pair that differs is reported with its largest difference and
the command exits with 1.
Not covered: speed (the bench measures it), GPUs' own kernels beyond naming the device.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from lab.engine import forward_path, native_forward, runtime
from lab.engine.forward_path import LEAN, MODEL, NATIVE, ForwardPath
from lab.engine.models import LoadedModel, load_model

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."
EXIT_OK, EXIT_DIFFER = 0, 1


@dataclass(frozen=True)
class Agreement:
    """One path compared with `model(...)` on the probe input."""

    path: str
    forwards: int
    bit_equal: bool
    max_abs_diff: float


def cpu_report(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model name, the relevant flags (yes / no; unknown off Linux) and PyTorch's CPU capability."""
    text = cpuinfo.read_text(errors="replace") if cpuinfo.is_file() else ""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "machine": platform.machine(),
        "cpu": fields.get("model name", platform.processor() or "unknown"),
        "flags": {flag: (flag in flags) if flags else None for flag in CPU_FLAGS},
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _probe(loaded: LoadedModel, ids: list[int], steps: int):
    """Yield the float32 logits [T, V] of a prefill of `ids`, then of `steps` one-token steps (fixed tokens, the
    prompt's own, so every path sees the same input)."""
    cache = DynamicCache(config=loaded.config)
    try:
        inputs = [ids] + [[ids[i % len(ids)]] for i in range(steps)]
        for chunk in inputs:
            tensor = torch.tensor([chunk], dtype=torch.long, device=loaded.device)
            logits, _ = runtime.model_forward(loaded, tensor, cache)
            yield logits[0].float()
    finally:
        cache.reset()


def path_logits(loaded: LoadedModel, path: ForwardPath, ids: list[int], steps: int = 2) -> list[torch.Tensor]:
    """The probe's logits with every forward pinned to `path`."""
    return list(forward_path.pinned(_probe(loaded, ids, steps), {id(loaded.model): path}))


def applicable_paths(loaded: LoadedModel, chosen: ForwardPath) -> list[ForwardPath]:
    """model(...) always; the lean loop for a model it runs; the op where the chooser picks it."""
    paths = [ForwardPath(MODEL, "doctor", chosen.row_invariant)]
    if chosen.lean:
        paths.append(ForwardPath(LEAN, "doctor", chosen.row_invariant))
    if chosen.native:
        paths.append(ForwardPath(NATIVE, "doctor", chosen.row_invariant))
    return paths


def agreement(loaded: LoadedModel, chosen: ForwardPath, ids: list[int]) -> list[Agreement]:
    """Each applicable path's probe logits against model(...)'s."""
    paths = applicable_paths(loaded, chosen)
    reference = path_logits(loaded, paths[0], ids)
    results = []
    for path in paths[1:]:
        got = path_logits(loaded, path, ids)
        equal = all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        diff = max(float((a - b).abs().max()) for a, b in zip(got, reference, strict=True))
        results.append(Agreement(path.name, len(got), equal, diff))
    return results


def report(loaded: LoadedModel, prompt: str = PROBE_TEXT) -> dict:
    """Everything the command prints, as plain values (waits for the op's build)."""
    op_built = native_forward.build() if loaded.device.type == "cpu" else False
    chosen = forward_path.choose(loaded, wait=True)
    ids = loaded.encode(prompt, chat=False)
    return {
        "machine": cpu_report(),
        "software": {"python": platform.python_version(), "torch": torch.__version__, **_transformers()},
        "native_op": {
            "built": op_built,
            "state": native_forward.build_state(),
            "toolchain": forward_path.toolchain_present(),
        },
        "model": {
            "spec": loaded.spec,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "precision": loaded.precision,
        },
        "forward_path": chosen.as_dict(),
        "probe_tokens": len(ids),
        "agreement": [asdict(a) for a in agreement(loaded, chosen, ids)],
    }


def _transformers() -> dict:
    import transformers

    return {"transformers": transformers.__version__}


def _yes(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def format_report(data: dict) -> str:
    machine, model, path, op = data["machine"], data["model"], data["forward_path"], data["native_op"]
    flags = ", ".join(f"{flag} {_yes(value)}" for flag, value in machine["flags"].items())
    lines = [
        f"machine: {machine['machine']}, {machine['cpu']}, {machine['threads']} threads",
        f"cpu flags: {flags}; torch dispatches {machine['torch_capability']}",
        "software: " + ", ".join(f"{k} {v}" for k, v in data["software"].items()),
        f"native op: {'built' if op['built'] else 'not built'} ({op['state']}; C++ compiler and ninja "
        f"{'found' if op['toolchain'] else 'not found'})",
        f"model: {model['spec']} on {model['device']}, {model['dtype']}, {model['precision']} weights, "
        f"row-invariant forwards {'on' if path['row_invariant'] else 'off'}",
        f"forward path: {path['name']} ({path['reason']})",
        f"agreement on one input ({data['probe_tokens']} prompt tokens, then 2 one-token steps), vs model(...):",
    ]
    for item in data["agreement"]:
        verdict = "bit-equal" if item["bit_equal"] else f"DIFFERENT (max |diff| {item['max_abs_diff']:.3g})"
        lines.append(f"  {item['path']}: {verdict} over {item['forwards']} forwards")
    if not data["agreement"]:
        lines.append("  (only model(...) applies to this model)")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    loaded = load_model(args.model, args.device, args.dtype, args.precision)
    data = report(loaded)
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    sys.stdout.flush()
    return EXIT_OK if all(item["bit_equal"] for item in data["agreement"]) else EXIT_DIFFER


def register(commands, evaluations, add_model_options) -> None:
    """`python -m lab doctor` (lab.tools.cli's plugin contract)."""
    doctor = commands.add_parser("doctor", help="which forward path runs here, why, and whether the paths agree")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    add_model_options(doctor)
    doctor.add_argument(
        "--precision", default="auto", help="weight format: bf16, int8, int4, w4a8, auto (as `run`; the default)"
    )
    doctor.set_defaults(handler=cmd_doctor)
