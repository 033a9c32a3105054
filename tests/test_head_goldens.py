"""The lab's published-head loaders against the reference implementations' goldens (tests/golden/heads_*.json).

scripts/make_head_goldens.py ran eagle-llm 1.2.1 (EAGLE-1/2), speculators 0.9.0 (EAGLE-3, its own format and
its converter of SafeAILab's EAGLE-3 layout) and medusa-llm 0.1 (Medusa) in a side venv on the checkpoints of
tests/published_ckpt.py and seeded inputs. Here the same checkpoints load through `lab.heads.published_build`
and the lab's draft distributions must equal the references' (fp32, to 2e-6 absolute), including EAGLE-3's
second step from the head's own outputs (`EagleCache.tree_step`). The tensor names (and shapes) and config
keys the references themselves write or load must equal what tests/published_ckpt.py writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lab.engine.models import wrap_model
from lab.heads.eagle import EagleCache
from lab.heads.published_build import load_eagle, load_medusa
from tests import published_ckpt as ckpt
from tests.tiny import ByteTokenizer, tiny_llama

GOLDEN = Path(__file__).parent / "golden"
D = ckpt.DIMS
ATOL = 2e-6


def golden(layout: str) -> dict:
    return json.loads((GOLDEN / f"heads_{layout}.json").read_text())


@pytest.fixture(scope="module")
def target():
    """A tiny 8-layer Llama whose embedding and LM head are the goldens' (the only target parts a head reads)."""
    model = tiny_llama(seed=0, layers=D["layers"], hidden=D["hidden"])
    embed, lm = ckpt.golden_target(D)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm)
    return wrap_model(model, ByteTokenizer(), spec="tiny-golden")


def stored_names(file: Path) -> dict[str, list[int]]:
    if file.suffix == ".safetensors":
        with safe_open(str(file), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    return {k: list(v.shape) for k, v in torch.load(str(file), weights_only=True).items()}


def test_eagle1_matches_eagle_llm(target, tmp_path) -> None:
    g = golden("eagle")
    folder = ckpt.write("eagle", tmp_path / "eagle", D, seed=g["seed"], embed=ckpt.golden_target(D)[0])
    assert stored_names(folder / "pytorch_model.bin") == {k: v[0] for k, v in g["reference_tensors"].items()}
    head = load_eagle(target, str(folder))
    features, tokens = ckpt.golden_inputs(D["hidden"], D)
    with torch.no_grad():
        out = head(features[None], tokens[None], torch.arange(len(tokens))[None])[0]
        q = head.logits(out).softmax(-1)  # [T, V]
    torch.testing.assert_close(q, torch.tensor(g["probs"]), atol=ATOL, rtol=0)


def eagle3_steps(head, fused: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft probabilities over V_d at step 0 (a causal chain of target features) and step 1 (at each row i: the
    committed pairs 0..i, then the head's own output o_i with the next token, as a one-node draft tree)."""
    n = len(tokens)
    with torch.no_grad():
        step0 = head.logits(head(fused[None], tokens[None], torch.arange(n)[None], fused=True)[0]).softmax(-1)
    rows = []
    for i in range(n):
        cache = EagleCache(head)
        o = cache.extend(fused[: i + 1], tokens[: i + 1].tolist(), 0)
        next_token = int(tokens[i + 1]) if i + 1 < n else 0  # speculators pads the teacher-forced ids with 0
        rows.append(cache.tree_step(o[None], [next_token], [i + 1], [0], [set()])[0])
    with torch.no_grad():
        step1 = head.logits(torch.stack(rows)).softmax(-1)
    return step0, step1


@pytest.mark.parametrize("layout", ["eagle3", "speculators-eagle3"])
def test_eagle3_matches_speculators(target, layout, tmp_path) -> None:
    g = golden(layout.replace("-", "_"))
    embed = ckpt.golden_target(D)[0] if layout == "speculators-eagle3" else None
    folder = ckpt.write(layout, tmp_path / layout, D, seed=g["seed"], embed=embed, layer_ids=[2, 4, 5], pickle=False)
    if layout == "speculators-eagle3":
        assert stored_names(folder / "model.safetensors") == {k: v[0] for k, v in g["reference_tensors"].items()}
        assert sorted(json.loads((folder / "config.json").read_text())) == g["reference_config_keys"]
    head = load_eagle(target, str(folder))
    assert head.vocab.tolist() == g["draft_ids"]
    fused, tokens = ckpt.golden_inputs(3 * D["hidden"], D)
    step0, step1 = eagle3_steps(head, fused, tokens)
    torch.testing.assert_close(step0, torch.tensor(g["steps"][0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(step1, torch.tensor(g["steps"][1]), atol=ATOL, rtol=0)


def test_medusa_matches_medusa_llm(target, tmp_path) -> None:
    g = golden("medusa")
    folder = ckpt.write("medusa", tmp_path / "medusa", D, seed=g["seed"], medusa_heads=3, medusa_layers=1)
    assert stored_names(folder / "medusa_lm_head.pt") == {k: v[0] for k, v in g["reference_tensors"].items()}
    heads = load_medusa(target, str(folder))
    h, _ = ckpt.golden_inputs(D["hidden"], D, length=2)
    probs = torch.stack([heads.probs(row) for row in h], dim=1)  # [K, T, V]
    torch.testing.assert_close(probs, torch.tensor(g["probs"]), atol=ATOL, rtol=0)
