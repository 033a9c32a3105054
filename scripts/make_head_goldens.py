"""Write tests/golden/heads_*.json: draft distributions of the reference implementations of published heads.

The reference packages pin other transformers versions and pull heavy extras, so they live in a side venv
outside the repository, never in requirements. From the repository root:

    python scripts/make_head_goldens.py --setup    # makes $REF_VENV (default /work/data/venv-ref), see below
    python scripts/make_head_goldens.py            # re-runs itself inside $REF_VENV and writes the goldens

`--setup` creates the venv with a .pth file that appends the lab's own venv (torch 2.13 CPU) at the end of
sys.path, then installs, without their dependency pins, transformers==5.19.0 (speculators' upper bound),
speculators==0.9.0, eagle-llm==1.2.1 and medusa-llm==0.1, plus what speculators imports at load time (openai,
datasets, hs-connectors; pip warns about eagle-llm's pins of gradio 3.50 / openai 0.28, which the classes used
here do not import). Every checkpoint comes from tests/published_ckpt.py (pure torch, the same bytes in
both venvs) and every input from seeded torch generators. What each golden holds:
- eagle (eagle-llm 1.2.1, `eagle.model.cnets.Model`, loaded with its own `load_state_dict(strict=True)` from the
  SafeAILab folder): q = softmax(W_lm Model(f, x)) at every position of a 4-pair causal chain;
- eagle3 / speculators-eagle3 (speculators 0.9.0, `Eagle3DraftModel.from_pretrained` of the speculators folder,
  eager attention; and speculators' `Eagle3Converter` applied to the SafeAILab EAGLE-3 folder): the draft
  logits of training-time-test steps 0 (fused target features) and 1 (the head's own outputs, teacher-forced
  tokens), captured at `lm_head`, over V_d, plus the draft vocabulary d2t maps to;
- medusa (medusa-llm 0.1, `medusa.model.medusa_model.ResBlock` in `MedusaModel`'s container, loaded from
  medusa_lm_head.pt): softmax of each head's logits at 2 positions.
Each golden also records the tensor names, shapes and dtypes and the config keys the reference itself writes
or loads, which tests/test_head_goldens.py compares with the lab's writers.
Not covered: Qwen2-style q/k/v biases in EAGLE-1 (eagle-llm 1.2.1's cnets has none; SafeAILab added them later).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("REF_VENV", "/work/data/venv-ref"))
OUT = ROOT / "tests" / "golden"
PACKAGES = ["transformers==5.19.0", "speculators==0.9.0", "eagle-llm==1.2.1", "medusa-llm==0.1"]
IMPORTED = ["openai", "datasets", "hs-connectors==0.9.0", "loguru", "pydantic-settings"]


def setup() -> None:
    """Create the side venv sharing the lab venv's torch (module docstring)."""
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (VENV / "lib" / py / "site-packages" / "zz_lab_venv.pth").write_text(site + "\n")
    pip = [str(VENV / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, "--no-deps", *PACKAGES], check=True)
    subprocess.run([*pip, *IMPORTED], check=True)


def rounded(t) -> list:
    return [[float(f"{v:.6g}") for v in row] for row in t.tolist()]


def assert_loaded(model, file: Path, rename=lambda name: name) -> None:
    """The reference model holds exactly the tensors of the lab-written file (no name silently skipped)."""
    import torch
    from safetensors.torch import load_file

    state = model.state_dict()
    for name, t in load_file(str(file)).items():
        assert torch.equal(state[rename(name)].float(), t.float()), name


def eagle_golden(work: Path) -> dict:
    import eagle
    import torch
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    from tests import published_ckpt as ckpt

    d = ckpt.DIMS
    embed, lm = ckpt.golden_target(d)
    folder = ckpt.write("eagle", work / "eagle", d, seed=11, embed=embed)
    config = EConfig(**json.loads((folder / "config.json").read_text()))
    if (config.rope_scaling or {}).get("rope_type") == "default":  # transformers 5 fills in a default dict
        config.rope_scaling = None  # where the 4.x EConfig eagle-llm was written for kept None (plain RoPE)
    model = Model(config, bias=True).float().eval()
    state = torch.load(str(folder / "pytorch_model.bin"))
    model.load_state_dict(state, strict=True)  # the reference's own loading: every name must fit
    features, tokens = ckpt.golden_inputs(d["hidden"], d)
    with torch.no_grad():
        out = model(features[None], tokens[None])[0]  # [T, H] f_hat
    return {
        "reference": f"eagle-llm {getattr(eagle, '__version__', '1.2.1')} eagle.model.cnets.Model",
        "seed": 11,
        "probs": rounded((out @ lm.T).softmax(-1)),
        "reference_tensors": {k: [list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()},
    }


def speculators_step_logits(model, fused, tokens) -> list:
    import torch

    captured = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()[0].clone()))
    with torch.no_grad():
        model(
            hidden_states=fused[None],
            input_ids=tokens[None],
            document_ids=torch.zeros(1, len(tokens), dtype=torch.long),
            ttt_steps=2,
        )
    hook.remove()
    return [rounded(step.softmax(-1)) for step in captured]


def make_verifier(work: Path, embed, lm) -> Path:
    """A tiny target saved like a Hub model, carrying the golden embedding and LM head (speculators reads both)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests import published_ckpt as ckpt

    config = {k: v for k, v in ckpt.llama_config(ckpt.DIMS).items() if k not in ("architectures", "torch_dtype")}
    model = LlamaForCausalLM(LlamaConfig(**{**config, "num_hidden_layers": ckpt.DIMS["layers"]}))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm)
    model.save_pretrained(str(work / "verifier"))
    return work / "verifier"


def point_at_verifier(folder: Path, verifier: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def load_speculators(folder: Path):
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    config = Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return Eagle3DraftModel.from_pretrained(str(folder), config=config).float().eval()


def eagle3_goldens(work: Path) -> dict[str, dict]:
    import importlib.metadata

    from safetensors import safe_open
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    from tests import published_ckpt as ckpt

    d, out = ckpt.DIMS, {}
    embed, lm = ckpt.golden_target(d)
    fused, tokens = ckpt.golden_inputs(3 * d["hidden"], d)
    verifier = make_verifier(work, embed, lm)
    version = f"speculators {importlib.metadata.version('speculators')}"
    # the speculators format, as the lab writes it, read by speculators itself
    folder = ckpt.write("speculators-eagle3", work / "spec", d, seed=12, embed=embed, layer_ids=[2, 4, 5])
    point_at_verifier(folder, verifier)
    model = load_speculators(folder)
    assert_loaded(model, folder / "model.safetensors")
    out["speculators-eagle3"] = {
        "reference": f"{version} Eagle3DraftModel.from_pretrained",
        "seed": 12,
        "steps": speculators_step_logits(model, fused, tokens),
        "draft_ids": (model.d2t + __import__("torch").arange(d["draft_vocab"])).tolist(),
    }
    # what speculators itself saves for the same config (layout cross-check of the lab's writer)
    model.save_pretrained(str(work / "spec-saved"))
    with safe_open(str(work / "spec-saved" / "model.safetensors"), "pt") as f:
        saved = {k: [list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()] for k in f.keys()}  # noqa: SIM118
    out["speculators-eagle3"]["reference_tensors"] = saved
    out["speculators-eagle3"]["reference_config_keys"] = sorted(
        json.loads((work / "spec-saved" / "config.json").read_text())
    )
    # SafeAILab's EAGLE-3 layout through speculators' own converter (midlayer.* -> layers.0.*)
    safeai = ckpt.write("eagle3", work / "eagle3", d, seed=13, layer_ids=[2, 4, 5], pickle=False)
    Eagle3Converter().convert(
        safeai, work / "converted", base_model=str(verifier), validate=False, eagle_aux_hidden_state_layer_ids=[2, 4, 5]
    )
    import torch

    converted = load_speculators(work / "converted")  # its embedding is the verifier's (the target's)
    assert_loaded(converted, safeai / "model.safetensors", lambda n: n.replace("midlayer.", "layers.0."))
    out["eagle3"] = {
        "reference": f"{version} Eagle3Converter + Eagle3DraftModel",
        "seed": 13,
        "steps": speculators_step_logits(converted, fused, tokens),
        "draft_ids": (converted.d2t + torch.arange(d["draft_vocab"])).tolist(),
    }
    return out


def medusa_golden(work: Path) -> dict:
    import torch
    from medusa.model.medusa_model import ResBlock
    from torch import nn

    from tests import published_ckpt as ckpt

    d, heads, layers = ckpt.DIMS, 3, 1
    folder = ckpt.write("medusa", work / "medusa", d, seed=14, medusa_heads=heads, medusa_layers=layers)
    # MedusaModel.__init__'s container, built the same way (it needs a base model and tokenizer otherwise)
    medusa_head = nn.ModuleList(
        [
            nn.Sequential(*([ResBlock(d["hidden"])] * layers), nn.Linear(d["hidden"], d["vocab"], bias=False))
            for _ in range(heads)
        ]
    )
    missing, unexpected = medusa_head.load_state_dict(torch.load(str(folder / "medusa_lm_head.pt")), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    h, _ = ckpt.golden_inputs(d["hidden"], d, length=2)
    with torch.no_grad():
        logits = torch.stack([head(h) for head in medusa_head])  # [K, T, V]
    return {
        "reference": "medusa-llm 0.1 medusa.model.medusa_model.ResBlock in MedusaModel's medusa_head",
        "seed": 14,
        "probs": [rounded(k.softmax(-1)) for k in logits],
        "reference_tensors": {k: [list(v.shape), str(v.dtype)] for k, v in medusa_head.state_dict().items()},
    }


def main() -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        goldens = {"eagle": eagle_golden(work), **eagle3_goldens(work), "medusa": medusa_golden(work)}
    for layout, golden in goldens.items():
        golden["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
        file = OUT / f"heads_{layout.replace('-', '_')}.json"
        file.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        print(f"wrote {file.relative_to(ROOT)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="create the reference venv first")
    args = parser.parse_args()
    if args.setup:
        setup()
    if Path(sys.prefix).resolve() != VENV.resolve():
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        sys.exit(subprocess.run([str(VENV / "bin" / "python"), __file__], env=env, cwd=ROOT).returncode)
    main()
