"""`make gpu-check`: every strategy on a CUDA device, on tiny random models built here (the device machine has no
network and the embedded GGUF is too large to carry), with heads written to a temporary folder and loaded through
`heads_path` as a user's would be.

1. Greedy exactness in fp32: every lossless method (SD with prompt lookup / self-draft / a draft model, SSD,
   Medusa, MTPC, EAGLE) against plain greedy, token for token, on a few prompts.
2. One sampled run of each of the ten strategies (all of them, on the tiny model: texts are noise, the point is
   that every tensor and generator lives on the device).
3. A short timing of greedy and two speculative methods (tokens/s; tiny models say nothing about real speedups).
Prints a summary table; exits 1 when a check fails. `--device cpu` runs the same checks on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.app.runner import make_generator  # noqa: E402
from lab.heads.common import model_shape, save_heads  # noqa: E402
from lab.heads.eagle import build_head, head_tensors  # noqa: E402
from lab.heads.mtpc import init_tensors  # noqa: E402
from lab.params import build_params  # noqa: E402
from lab.registry import collect, get_strategy, registry  # noqa: E402
from lab.trace import TokenEmitted  # noqa: E402
from tests.tiny import ByteTokenizer, tiny_llama  # noqa: E402

PROMPTS = ["the cat sat on the mat and the cat", "speculative decoding, 2023: ", "abcabcabcabc"]
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
LOSSLESS = {
    "sd-lookup": ("speculative", {"drafter": "prompt-lookup"}),
    "sd-self": ("speculative", {"drafter": "self-draft", "draft_layers": 1, "gamma": 3}),
    "sd-model": ("speculative", {"drafter": "model", "gamma": 4}),
    "ssd": ("ssd", {"drafter": "self-draft", "draft_layers": 1, "gamma": 3}),
    "medusa": ("medusa", {}),
    "mtpc": ("mtpc", {}),
    "eagle": ("eagle", {}),
}
SAMPLED = {
    "sample": {},
    "dola": {},
    "cfg": {},
    "mirostat": {},
    "speculative": {"temperature": 0.8},
    "ssd": {"temperature": 0.8, "draft_layers": 1},
    "medusa": {"mode": "sample"},
    "mtpc": {"mode": "sample"},
    "eagle": {"mode": "sample"},
    "tot": {},
    "rlm": {},
    "greedy": {},
}


def write_heads(loaded, folder: Path) -> dict[str, str]:
    """Random Medusa / MTPC / EAGLE heads for `loaded`, saved as the lab saves trained ones; kind -> path."""
    hidden, vocab, generator = int(loaded.config.hidden_size), loaded.vocab_size, torch.Generator().manual_seed(1)
    shape, ids = model_shape(loaded), torch.arange(vocab)
    medusa = {
        "blocks.weight": 0.05 * torch.randn(4, hidden, hidden, generator=generator),
        "blocks.bias": torch.zeros(4, hidden),
        "vocab": ids,
    }
    mtpc = {**init_tensors(3, 3, 4, hidden, seed=0), "vocab": ids}
    eagle = head_tensors(build_head(loaded, ids))
    paths = {}
    for kind, tensors, extra in (("medusa", medusa, {"heads": 4}), ("mtpc", mtpc, {"heads": 3}), ("eagle", eagle, {})):
        config = {"kind": kind, "model_shape": shape, "choices": CHOICES, **extra}
        save_heads(folder / kind, tensors, config)
        paths[kind] = str(folder / kind)
    return paths


def tokens(loaded, name: str, ids: list[int], values: dict, seed: int = 0) -> list[int]:
    strategy = get_strategy(name)
    params = build_params(strategy.Params, values)
    events = collect(strategy.run(loaded, ids, params, make_generator(seed, loaded.device)))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def check(rows: list, label: str, fn) -> None:
    start = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as error:  # reported in the table, with the traceback below it
        ok, detail = False, f"{type(error).__name__}: {error}"
        traceback.print_exc()
    rows.append((label, "ok" if ok else "FAIL", detail, time.perf_counter() - start))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU visible to torch {torch.__version__}; nothing to check.")
        return 0
    from lab.engine.models import wrap_model

    device = torch.device(args.device)
    loaded = wrap_model(tiny_llama(0, layers=2).to(device), ByteTokenizer(), spec="tiny-llama-gpu-check")
    rows: list = []
    with tempfile.TemporaryDirectory() as folder:
        heads = write_heads(loaded, Path(folder))
        for label, (name, values) in LOSSLESS.items():
            extra = {"heads_path": heads[name]} if name in heads else {}
            if name == "speculative" and values.get("drafter") == "model":
                extra = {"draft_model": ""}  # the target itself: the draft model path on this device

            def exact(name=name, values={**values, **extra}):  # noqa: B006 (called at once by check)
                same = 0
                for text in PROMPTS:
                    ids = loaded.encode(text)
                    ref = tokens(loaded, "greedy", ids, {"max_new_tokens": args.tokens})
                    same += tokens(loaded, name, ids, {"max_new_tokens": args.tokens, **values}) == ref
                return same == len(PROMPTS), f"{same}/{len(PROMPTS)} prompts equal greedy"

            check(rows, f"greedy exact  {label}", exact)
        for name in registry():
            values = {**SAMPLED.get(name, {}), **({"heads_path": heads[name]} if name in heads else {})}

            def sampled(name=name, values=values):
                prompt = "4 9 10 13" if name == "tot" else PROMPTS[0]  # ToT's default task is a Game of 24
                out = tokens(loaded, name, loaded.encode(prompt), {"max_new_tokens": 8, **values}, seed=3)
                return bool(out) or name in ("tot", "rlm"), f"{len(out)} tokens"

            check(rows, f"sampled run   {name}", sampled)
        for name, values in (("greedy", {}), ("speculative", {}), ("eagle", {"heads_path": heads["eagle"]})):

            def speed(name=name, values=values):
                start = time.perf_counter()
                n = len(tokens(loaded, name, loaded.encode(PROMPTS[2]), {"max_new_tokens": 64, **values}))
                return True, f"{n / (time.perf_counter() - start):.1f} tok/s"

            check(rows, f"bench         {name}", speed)
    print(
        f"\ngpu-check on {device} ({torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}), torch "
        f"{torch.__version__}"
    )
    for label, status, detail, seconds in rows:
        print(f"{label:30s} {status:5s} {detail:45s} {seconds:6.1f} s")
    return 0 if all(status == "ok" for _, status, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
