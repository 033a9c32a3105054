"""Training that survives interruption (checkpoint + resume replays the same steps) and EAGLE-3 training on a
tiny random Llama (fused features, draft vocabulary with d2t / t2d, unrolled training-time test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lab.heads.checkpoint import Checkpoint
from lab.params import InputError
from lab.training.cli import TrainOptions
from lab.training.distill.dataset import load_distill
from lab.training.distill.generate import DistillSettings, run_distill
from lab.training.medusa_train import fit
from tests.tiny import tiny_loaded_model


class Stop(Exception):
    pass


def _problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 8, generator=generator), torch.randn(64, generator=generator)
    params = {"w": torch.zeros(8, requires_grad=True), "b": torch.zeros(1, requires_grad=True)}
    return params, lambda rows: ((x[rows] @ params["w"] + params["b"] - y[rows]) ** 2).mean()


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    options = TrainOptions(epochs=5, batch_size=8, lr=0.05, eval_every=10)
    rows = torch.arange(64)
    params, loss = _problem()
    fit(params, loss, rows, options, lambda _: None, lambda step: {}, None)
    reference = {n: p.detach().clone() for n, p in params.items()}

    path = tmp_path / "run.ckpt"

    def interrupt(step: int) -> dict:
        if step == 20:
            raise Stop
        return {"held_out": {"top1": [0.5]}}

    params, loss = _problem()
    with pytest.raises(Stop):
        fit(params, loss, rows, options, lambda _: None, interrupt, Checkpoint(path, {"a": 1}, print, every_s=0))
    assert torch.load(path, weights_only=True)["step"] == 19  # saved after every step, the last before the stop
    params, loss = _problem()  # a fresh process: the tensors start from scratch
    log: list[str] = []
    fit(params, loss, rows, options, log.append, lambda step: {}, Checkpoint(path, {"a": 1}, log.append, every_s=0))
    assert any("resumed" in line and "step 19" in line for line in log)
    for name, value in reference.items():
        assert torch.allclose(params[name], value, atol=1e-6)
    metrics = path.with_suffix(".metrics.jsonl").read_text().splitlines()
    assert '"step": 0,' in metrics[0] and '"step": 10,' in metrics[1] and '"top1": [0.5]' in metrics[1]
    assert '"step": 40,' in metrics[-1]
    with pytest.raises(InputError, match="other options"):
        Checkpoint(path, {"a": 2}, print).restore(*_problem()[:1], torch.optim.AdamW(_problem()[0].values()))


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory):
    from lab.training import eagle3_train

    loaded = tiny_loaded_model(seed=0, layers=8)
    folder = tmp_path_factory.mktemp("eagle3")
    layers = tuple(eagle3_train.data_layers(loaded))
    settings = DistillSettings("tiny", max_new_tokens=24, batch_size=4, limit=16, top_k=8, layers=layers)
    run_distill(loaded, settings, folder / "data", lambda *_: None)
    data = load_distill(folder / "data", layers=layers)
    torch.manual_seed(0)
    log: list[str] = []
    options = TrainOptions(epochs=8, lr=3e-3, batch_size=64, draft_vocab=64, unroll=3, eval_every=1000)
    head, config = eagle3_train.train(loaded, data, options, log.append)
    eagle3_train.save(folder / "eagle3", head, {**config, "kind": "eagle3"})
    return loaded, data, head, config, log, folder


def test_eagle3_training_lowers_the_held_out_loss_at_every_step(eagle3_run) -> None:
    _, _, _, config, log, _ = eagle3_run
    first = eval([line for line in log if line.startswith("held out")][0].split(": ", 1)[1])  # noqa: S307
    last = config["held_out"]
    assert set(last) >= {"ce@0", "ce@1", "ce@2", "top1@0", "top1@2"}
    assert last["ce@0"] < first["ce@0"] and last["ce@2"] < first["ce@2"]
    assert "fused" not in log[0] and "layers [2, 4, 5]" in log[0]


def test_the_saved_eagle3_head_maps_draft_ids_to_target_ids(eagle3_run) -> None:
    from safetensors.torch import load_file

    from lab.heads.eagle3 import build_eagle3

    loaded, data, head, _, _, folder = eagle3_run
    tensors = load_file(str(folder / "eagle3" / "model.safetensors"))
    assert tensors["fc.weight"].shape == (64, 3 * 64) and "embed_tokens.weight" not in tensors

    config = json.loads((folder / "eagle3" / "config.json").read_text())
    assert config["lab_context"] == "last" and config["draft_vocab_size"] == head.draft_vocab_size
    rebuilt = build_eagle3(config, loaded.embeddings, tensors)
    vocab = rebuilt.vocab  # draft id i -> target id i + d2t[i]
    assert torch.equal(vocab, head.vocab) and bool(rebuilt.t2d[vocab].all()) and int(rebuilt.t2d.sum()) == len(vocab)
    counts = data.token_frequencies(loaded.vocab_size)
    assert counts[vocab].sum() >= counts.sort(descending=True).values[: len(vocab)].sum() * 0.99
    # the frozen LM head is the target's rows of V_d
    assert torch.allclose(rebuilt.lm_head.weight.float(), loaded.lm_head.weight[vocab].float(), atol=1e-2)
