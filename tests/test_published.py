"""Published heads through `heads_path` (lab.heads.published / published_build) on tiny random Llama and Qwen2.

For each layout (SafeAILab EAGLE-1/2, SafeAILab EAGLE-3, speculators EAGLE-3, FasterDecoding Medusa) a
checkpoint is written in exactly that layout (tests/published_ckpt.py), recognised by its files and config
keys, loaded through the strategy's `heads_path`, and greedy EAGLE / Medusa equal plain greedy token for token;
a sampled run completes and repeats with its seed. Bad checkpoints (wrong hidden size, a missing tensor, a
pickle that `weights_only` rejects, a truncated file, a folder in no layout, fused layers the target lacks, an
unreachable Hub id) each get their own message, and the next good run still works.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lab.engine.models import wrap_model
from lab.heads import published_build
from lab.heads.eagle import EagleHead
from lab.heads.eagle3 import Eagle3Head
from lab.heads.published import detect, is_lab_stem, resolve_folder
from lab.params import InputError, build_params
from strategies import collect, get_strategy
from tests import published_ckpt as ckpt
from tests.tiny import ByteTokenizer, tiny_llama

D = ckpt.DIMS
LAYOUTS = ("eagle", "eagle3", "speculators-eagle3", "medusa")


def tiny_qwen2(seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=D["vocab"],
        hidden_size=D["hidden"],
        intermediate_size=D["intermediate"],
        num_hidden_layers=D["layers"],
        num_attention_heads=D["heads"],
        num_key_value_heads=D["kv_heads"],
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    if request.param == "llama":
        model = tiny_llama(seed=5, layers=D["layers"], hidden=D["hidden"])
    else:
        model = tiny_qwen2(seed=6)
    return wrap_model(model, ByteTokenizer(), spec=f"tiny-{request.param}")


def write(layout: str, folder: Path, target, **kwargs) -> Path:
    qwen = type(target.model).__name__.startswith("Qwen2")
    embed = target.embeddings.weight.detach()
    extra = {"qkv_bias": qwen} if layout == "eagle" else {}
    return ckpt.write(layout, folder, embed=embed, **extra, **kwargs)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(strategy: str, loaded, prompt: list[int], seed: int = 0, **values) -> list[int]:
    s = get_strategy(strategy)
    events = collect(s.run(loaded, prompt, build_params(s.Params, values), gen(seed)))
    return [e.token_id for e in events if type(e).__name__ == "TokenEmitted"]


def strategy_of(layout: str) -> str:
    return "medusa" if layout == "medusa" else "eagle"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_recognised_and_greedy_equals_plain_greedy(target, layout, tmp_path, one_thread) -> None:
    folder = write(layout, tmp_path / layout, target)
    assert detect(folder).layout == layout and not is_lab_stem(str(folder))
    prompt = target.encode("published heads: the lab reads them", chat=False)
    plain = tokens("greedy", target, prompt, max_new_tokens=24)
    drafted = tokens(strategy_of(layout), target, prompt, max_new_tokens=24, heads_path=str(folder))
    assert drafted == plain
    head = published_build.cached(strategy_of(layout), target, str(folder))
    expected = {"eagle": EagleHead, "eagle3": Eagle3Head, "speculators-eagle3": Eagle3Head}.get(layout)
    assert expected is None or isinstance(head, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampled_run_completes_and_repeats_with_its_seed(target, layout, tmp_path, one_thread) -> None:
    folder = write(layout, tmp_path / layout, target, pickle=False)  # the safetensors variant of each layout
    prompt = target.encode("sampling", chat=False)
    values = {"max_new_tokens": 16, "heads_path": str(folder), "mode": "sample", "temperature": 1.0}
    first = tokens(strategy_of(layout), target, prompt, seed=3, **values)
    assert 1 <= len(first) <= 16 and all(0 <= t < D["vocab"] for t in first)
    assert tokens(strategy_of(layout), target, prompt, seed=3, **values) == first


def test_eagle3_explicit_layer_ids_and_two_residual_layers_in_medusa(target, tmp_path, one_thread) -> None:
    prompt = target.encode("options", chat=False)
    plain = tokens("greedy", target, prompt, max_new_tokens=16)
    folder = write("eagle3", tmp_path / "ids", target, layer_ids=[1, 3, 7])
    head = published_build.cached("eagle", target, str(folder))
    assert head.layer_ids == [1, 3, 7] and head.fc.in_features == 3 * D["hidden"]
    assert tokens("eagle", target, prompt, max_new_tokens=16, heads_path=str(folder)) == plain
    folder = write("medusa", tmp_path / "medusa2", target, medusa_heads=4, medusa_layers=2)
    heads = published_build.cached("medusa", target, str(folder))
    assert heads.weight.shape == (4, 2, D["hidden"], D["hidden"]) and heads.lm_weight.shape[1] == D["vocab"]
    assert tokens("medusa", target, prompt, max_new_tokens=16, heads_path=str(folder), tree_nodes=16) == plain


class NotATensor:
    pass


def _bad(kind: str, folder: Path, target) -> Path:
    """One broken checkpoint per kind (see the test below)."""
    if kind == "hidden size":
        return ckpt.write("eagle3", folder, {**D, "hidden": 48})
    if kind == "missing tensor":
        folder = write("eagle3", folder, target, pickle=False)
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        del tensors["midlayer.hidden_norm.weight"]
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    if kind == "pickle":
        folder = write("medusa", folder, target)
        torch.save({"0.0.linear.weight": torch.zeros(1), "payload": NotATensor()}, str(folder / "medusa_lm_head.pt"))
        return folder
    if kind in ("truncated safetensors", "truncated pickle"):
        folder = write("eagle", folder, target, pickle=kind.endswith("pickle"))
        file = next(p for p in folder.iterdir() if p.name != "config.json")
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        return folder
    if kind == "no layout":
        folder.mkdir(parents=True)
        (folder / "weights.txt").write_text("nothing here")
        return folder
    if kind == "layer ids":
        return write("eagle3", folder, target, layer_ids=[2, 4, 12])
    raise ValueError(kind)


BAD = {
    "hidden size": r"does not fit tiny-\w+: hidden size 48 vs 32 \(head vs target\)",
    "missing tensor": r"missing \['midlayer.hidden_norm.weight'\]",
    "pickle": r"Refused .*medusa_lm_head.pt: torch.load\(weights_only=True\) rejects this pickle",
    "truncated safetensors": r"not a complete safetensors file \(truncated\?\)",
    "truncated pickle": r"the pickle is incomplete or corrupt \(truncated\?\)",
    "no layout": r"No head weights in .* expected a published head folder: SafeAILab EAGLE-1/2",
    "layer ids": r"fuses target layers \[2, 4, 12\], which tiny-\w+ \(8 layers\) does not have",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_checkpoints_get_clear_messages_and_the_next_run_works(target, kind, tmp_path, one_thread) -> None:
    folder = _bad(kind, tmp_path / "bad", target)
    strategy = "medusa" if kind == "pickle" else "eagle"
    prompt = target.encode("bad", chat=False)
    with pytest.raises(InputError, match=BAD[kind]):
        tokens(strategy, target, prompt, max_new_tokens=4, heads_path=str(folder))
    good = write("eagle3", tmp_path / "good", target)
    assert tokens("eagle", target, prompt, max_new_tokens=4, heads_path=str(good)) == tokens(
        "greedy", target, prompt, max_new_tokens=4
    )


def test_pickle_refusal_is_weights_only(tmp_path) -> None:
    file = tmp_path / "x.pt"
    torch.save({"w": NotATensor()}, str(file))
    with pytest.raises(pickle.UnpicklingError):  # what the lab relies on: torch refuses, nothing is executed
        torch.load(str(file), weights_only=True)


def test_wrong_kind_for_the_strategy(target, tmp_path) -> None:
    folder = write("medusa", tmp_path / "m", target)
    with pytest.raises(InputError, match="holds medusa heads; the EAGLE strategy needs an EAGLE head"):
        tokens("eagle", target, target.encode("x", chat=False), max_new_tokens=2, heads_path=str(folder))


def test_hub_ids_are_downloaded_with_only_config_and_weights(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    calls = []

    def fake_snapshot(repo_id, allow_patterns):
        calls.append((repo_id, tuple(allow_patterns)))
        if repo_id == "nobody/missing":
            raise OSError("offline")
        return str(ckpt.write("eagle3", tmp_path / "hub"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert detect(resolve_folder("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")).layout == "eagle3"
    assert calls[0][0] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" and "config.json" in calls[0][1]
    assert all(p.endswith((".json", ".safetensors", ".bin", ".pt")) for p in calls[0][1])
    with pytest.raises(InputError, match="downloading it from the Hugging Face Hub failed .OSError: offline."):
        resolve_folder("nobody/missing")
    with pytest.raises(InputError, match="neither a folder, a lab head file, nor a Hub id"):
        resolve_folder("not a path/or id/at all")


def _prefill(target, prompt: list[int]):
    with torch.no_grad():
        out = target.model(torch.tensor([prompt]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states), int(out.logits[0, -1].argmax())


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "speculators-eagle3"])
def test_first_draft_is_the_heads_top_k_over_the_whole_prompt(target, layout, tmp_path) -> None:
    """Wiring: tensors land under the right names, the head reads fused (EAGLE-3) or last features of every
    prompt position paired with the next token, and draft ids map through d2t."""
    from lab.heads.eagle3 import target_features
    from lab.trace import EagleDraft

    folder = write(layout, tmp_path / layout, target)
    head = published_build.cached("eagle", target, str(folder))
    stored = detect(folder).tensors
    names = {
        "eagle": lambda n: n.replace("layers.0.", "layer."),
        "speculators-eagle3": lambda n: n.replace("layers.0.", "midlayer."),
    }.get(layout, lambda n: n)
    state = head.state_dict()
    for name, t in stored.items():
        if name != "embed_tokens.weight":
            torch.testing.assert_close(state[names(name)].float(), t.float())
    prompt = target.encode("the whole prompt is context", chat=False)
    hidden, root = _prefill(target, prompt)
    features = target_features(head, hidden)  # [n, F]
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        out = head(features[None], torch.tensor([prompt[1:] + [root]]), positions)[0, -1]
        q = head.logits(out).float().softmax(-1)
    top = q.topk(4)
    s = get_strategy("eagle")
    params = build_params(s.Params, {"max_new_tokens": 8, "heads_path": str(folder), "branch": 4, "depth": 2})
    draft = next(e for e in s.run(target, prompt, params, gen()) if isinstance(e, EagleDraft))
    assert draft.tokens[:4] == head.vocab[top.indices].tolist()
    assert draft.q[:4] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_medusa_tree_uses_each_heads_own_output_layer(target, tmp_path) -> None:
    from lab.trace import TreeRound

    folder = write("medusa", tmp_path / "medusa", target)
    t = detect(folder).tensors
    prompt = target.encode("medusa heads", chat=False)
    hidden, _ = _prefill(target, prompt)
    h = hidden[-1][-1].float()
    expected = []
    for k in range(3):  # Cai et al. 2024, Eq. 1 with head k's own W_k: softmax(W_k (h + SiLU(W h + b)))
        u = h + torch.nn.functional.silu(t[f"{k}.0.linear.weight"].float() @ h + t[f"{k}.0.linear.bias"].float())
        expected.append((t[f"{k}.1.weight"].float() @ u).softmax(-1).topk(8).indices.tolist())
    s = get_strategy("medusa")
    params = build_params(s.Params, {"max_new_tokens": 4, "heads_path": str(folder)})
    first = next(e for e in s.run(target, prompt, params, gen()) if isinstance(e, TreeRound))
    assert first.head_top_ids == expected


def test_the_app_handler_shows_the_message_and_keeps_serving(tmp_path) -> None:
    """Through the app's gradio-free run path (ui.common.stream_trace): a bad head is a gr.Error with the
    loader's message, and the next request with a good head streams to its final trace."""
    import time

    import gradio as gr

    from lab.app.validation import validate_request
    from tests.test_draft_pairs import byte_tokenizer, save_model
    from ui.common import stream_trace

    tokenizer = byte_tokenizer(None)
    model = save_model(tmp_path / "model", 0, tokenizer, layers=D["layers"])
    dims = {**D, "vocab": len(tokenizer)}
    bad = ckpt.write("eagle3", tmp_path / "bad", {**dims, "hidden": 48})
    good = ckpt.write("eagle3", tmp_path / "good", dims)

    def request(folder):
        params = {"heads_path": str(folder), "max_new_tokens": 6}
        return validate_request("eagle", "hello", params, model=model, device="cpu", dtype="float32", chat=False)

    with pytest.raises(gr.Error, match="hidden size 48 vs 32"):
        list(stream_trace(request(bad), time.monotonic() + 60))
    *_, (trace, final, _, _) = stream_trace(request(good), time.monotonic() + 60)
    assert final and sum(type(e).__name__ == "TokenEmitted" for e in trace.events) == 6


def test_lab_context_last_reads_from_the_last_prompt_position(target, tmp_path) -> None:
    import json

    folder = write("eagle3", tmp_path / "lab", target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "lab_context": "last"}))
    assert published_build.cached("eagle", target, str(folder)).reads_prompt is False
    assert published_build.cached("eagle", target, str(write("eagle3", tmp_path / "pub", target))).reads_prompt
    prompt = target.encode("context", chat=False)
    plain = tokens("greedy", target, prompt, max_new_tokens=12)
    assert tokens("eagle", target, prompt, max_new_tokens=12, heads_path=str(folder)) == plain


def test_a_narrower_eagle3_draft_brings_its_own_embedding(target, tmp_path) -> None:
    """speculators' `target_hidden_size`: fc reads 3 x the target's H, the draft layer runs at its own width."""
    import json

    from safetensors.torch import load_file, save_file

    narrow = {**D, "hidden": 16, "intermediate": 32}
    folder = ckpt.write("speculators-eagle3", tmp_path / "narrow", narrow, embed=torch.randn(D["vocab"], 16))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"] = torch.randn(16, 3 * D["hidden"]).half()  # 3 x the target's hidden size
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "target_hidden_size": D["hidden"]}))
    head = published_build.cached("eagle", target, str(folder))
    assert head.fc.in_features == 3 * D["hidden"] and head.fc.out_features == 16
    prompt = target.encode("narrow", chat=False)
    assert tokens("eagle", target, prompt, max_new_tokens=10, heads_path=str(folder)) == tokens(
        "greedy", target, prompt, max_new_tokens=10
    )


@pytest.mark.embedded
def test_eagle3_layout_on_the_embedded_model(embedded, tmp_path) -> None:
    """A SafeAILab EAGLE-3 checkpoint (pickle, as yuhuili's) for SmolLM2-135M's shape: greedy EAGLE = greedy."""
    c = embedded.config
    dims = {
        "hidden": c.hidden_size,
        "intermediate": c.intermediate_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "vocab": embedded.vocab_size,
        "layers": embedded.num_layers,
        "draft_vocab": 4096,
    }
    folder = ckpt.write("eagle3", tmp_path / "smollm2-eagle3", dims)
    head = published_build.cached("eagle", embedded, str(folder))
    assert head.layer_ids == [2, 15, 27]  # 2, L // 2, L - 3 of a 30-layer model
    prompt = embedded.encode("Explain speculative decoding in one sentence.")
    plain = tokens("greedy", embedded, prompt, max_new_tokens=16)
    drafted = tokens("eagle", embedded, prompt, max_new_tokens=16, heads_path=str(folder), total_tokens=8, depth=2)
    assert drafted == plain


def test_eagle1_biases_the_config_rules_out_are_zero(target, tmp_path) -> None:
    """`"bias": false` (no fc.bias) and no `qkv_bias` (no q/k/v biases, on Qwen2 whose layer has them)."""
    import json

    folder = ckpt.write("eagle", tmp_path / "nobias", embed=target.embeddings.weight.detach())  # no qkv biases
    tensors = torch.load(str(folder / "pytorch_model.bin"), weights_only=True)
    del tensors["fc.bias"]
    torch.save(tensors, str(folder / "pytorch_model.bin"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bias": False}))
    head = published_build.cached("eagle", target, str(folder))
    assert not head.fc.bias.any()
    q_bias = head.layer.self_attn.q_proj.bias
    assert q_bias is None if type(target.model).__name__.startswith("Llama") else not q_bias.any()
    assert head._target["lm_weight"].data_ptr() == target.lm_head.weight.data_ptr()  # no copy of the LM head
    prompt = target.encode("biases", chat=False)
    plain = tokens("greedy", target, prompt, max_new_tokens=10)
    assert tokens("eagle", target, prompt, max_new_tokens=10, heads_path=str(folder)) == plain
