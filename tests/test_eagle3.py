"""The EAGLE-3 draft head (lab.heads.eagle3): SafeAILab's layout, its math, the fused/own feature switch, the cache.

On a tiny random 8-layer Llama (so that the default fused layers 2, 4, 5 are distinct): the state dict has
exactly SafeAILab's names and shapes; the forward equals a from-scratch re-statement of cnets.py's math
(explicit RMSNorm, RoPE, GQA attention, SwiGLU) on a short chain; `EagleCache` runs it unchanged (a tree step
equals running each path as a chain); saving writes a SafeAILab folder that loads back to the same logits;
d2t/t2d map the draft vocabulary.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lab.heads.eagle import EagleCache
from lab.heads.eagle3 import (
    build_eagle3,
    default_layer_ids,
    fuse_features,
    head_config,
    save_eagle3,
    vocab_maps,
)
from tests.tiny import tiny_llama

H, V, VD = 32, 256, 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=8, hidden=H)


def random_head(target, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = head_config(target.config, VD, **overrides)
    head = build_eagle3(config, target.get_input_embeddings())
    with torch.no_grad():  # random norms and a random draft vocabulary, so nothing is trivially 1 or identity
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
        draft_ids = torch.sort(torch.randperm(V)[:VD]).values
        d2t, t2d = vocab_maps(draft_ids, V)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head, config, draft_ids


def test_state_dict_is_safeailab_layout(target) -> None:
    head, config, _ = random_head(target)
    kv = 2 * (H // 4)  # 2 kv heads of head_dim 8
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.self_attn.q_proj.weight": (H, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, H),
        "midlayer.mlp.gate_proj.weight": (2 * H, H),
        "midlayer.mlp.up_proj.weight": (2 * H, H),
        "midlayer.mlp.down_proj.weight": (H, 2 * H),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (VD, H),
        "d2t": (VD,),
        "t2d": (V,),
    }
    assert {name: tuple(t.shape) for name, t in head.state_dict().items()} == expected
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] == default_layer_ids(8)
    assert config["draft_vocab_size"] == VD and config["num_hidden_layers"] == 1


def test_default_layers_need_three_distinct_layers() -> None:
    assert default_layer_ids(32) == [2, 16, 29]  # Llama-3.1-8B
    with pytest.raises(ValueError, match="distinct"):
        default_layer_ids(4)


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [T, heads, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None]  # [T, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def reference_chain(head, config, features, tokens, positions, embedding) -> torch.Tensor:
    """SafeAILab cnets.py's Model.forward + midlayer on one causal chain, restated with explicit formulas."""
    sd = {k: v.float() for k, v in head.state_dict().items()}
    eps, heads, kv_heads, d = config["rms_norm_eps"], 4, 2, H // 4
    g = features @ sd["fc.weight"].T  # [T, H]
    e = embedding[tokens]
    a = torch.cat(
        [_rms(e, sd["midlayer.input_layernorm.weight"], eps), _rms(g, sd["midlayer.hidden_norm.weight"], eps)], -1
    )
    q = (a @ sd["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, d)
    k = (a @ sd["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, d)
    v = (a @ sd["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
    q, k = _rope(q, positions, config["rope_theta"]), _rope(k, positions, config["rope_theta"])
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    attn = torch.einsum("hts,shd->thd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).reshape(-1, H)
    u = g + attn @ sd["midlayer.self_attn.o_proj.weight"].T
    x = _rms(u, sd["midlayer.post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(x @ sd["midlayer.mlp.gate_proj.weight"].T) * (
        x @ sd["midlayer.mlp.up_proj.weight"].T
    )
    return u + mlp @ sd["midlayer.mlp.down_proj.weight"].T


def test_forward_matches_the_reference_math(target) -> None:
    head, config, _ = random_head(target)
    torch.manual_seed(1)
    ids = torch.randint(1, V, (1, 7))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    features = fuse_features(tuple(h[0] for h in hidden), config["eagle_aux_hidden_state_layer_ids"])  # [7, 3H]
    torch.testing.assert_close(features[:, :H], hidden[2][0])  # the input of layer 2 comes first
    tokens, positions = torch.randint(1, V, (7,)), torch.arange(3, 10)
    with torch.no_grad():
        out = head(features[None], tokens[None], positions[None], fused=True)[0]
        logits = head.logits(out)
    expected = reference_chain(head, config, features, tokens, positions, target.get_input_embeddings().weight)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    w = head.state_dict()
    torch.testing.assert_close(logits, _rms(expected, w["norm.weight"], config["rms_norm_eps"]) @ w["lm_head.weight"].T)


def test_fused_flag_is_explicit_or_told_by_width(target) -> None:
    head, _, _ = random_head(target)
    tokens, positions = torch.tensor([[5, 6]]), torch.tensor([[0, 1]])
    with torch.no_grad():
        fused = torch.randn(1, 2, 3 * H)
        torch.testing.assert_close(head(fused, tokens, positions), head(fused, tokens, positions, fused=True))
        own = torch.randn(1, 2, H)
        torch.testing.assert_close(head(own, tokens, positions), head(own, tokens, positions, fused=False))
        # explicit: own outputs skip fc, which a width-H input cannot go through
        assert not torch.allclose(head(head.fc(fused), tokens, positions, fused=False), head(own, tokens, positions))
        with pytest.raises(ValueError, match="expected 96 .fused target features. or 32"):
            head(torch.randn(1, 2, 2 * H), tokens, positions)


def test_eagle_cache_drives_the_head_tree_equals_chains(target) -> None:
    head, _, _ = random_head(target)
    features = torch.randn(5, 3 * H)  # fused target features of the committed pairs, p = 3..7
    cache = EagleCache(head)
    o = cache.extend(features, [5, 6, 7, 8, 9], 3)
    out01 = cache.tree_step(torch.stack([o, o]), [11, 12], [8, 8], [0, 1], [set(), set()])
    out2 = cache.tree_step(out01[1:2], [13], [9], [2], [{1}])
    for path_features, path_tokens, expected in (([o], [11], out01[0]), ([o, out01[1]], [12, 13], out2[0])):
        chain = EagleCache(head)
        chain.extend(features, [5, 6, 7, 8, 9], 3)
        last = chain.extend(torch.stack(path_features), path_tokens, 8)  # own outputs: width H, no fc
        torch.testing.assert_close(last, expected, rtol=1e-5, atol=1e-5)
    cache.rollback()
    assert cache.committed == 5 and cache.cache.get_seq_length() == 5


def test_vocab_maps_and_draft_ids(target) -> None:
    head, _, draft_ids = random_head(target)
    assert torch.equal(head.vocab, draft_ids)  # target id = draft id + d2t[draft id]
    assert torch.equal(torch.nonzero(head.t2d)[:, 0], draft_ids)


def test_save_writes_a_safeailab_folder_that_loads_back(target, tmp_path) -> None:
    head, config, _ = random_head(target)
    folder = save_eagle3(tmp_path / "head", head, config)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    stored = json.loads((folder / "config.json").read_text())
    assert stored["draft_vocab_size"] == VD and stored["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    assert dtypes.pop("d2t") == torch.int64 and dtypes.pop("t2d") == torch.bool
    assert set(dtypes.values()) == {torch.float16}
    loaded = build_eagle3(stored, target.get_input_embeddings(), load_file(str(folder / "model.safetensors")))
    features, tokens, positions = torch.randn(1, 4, 3 * H), torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    head16 = build_eagle3(
        config,
        target.get_input_embeddings(),
        {k: v.half().float() if v.is_floating_point() else v for k, v in head.state_dict().items()},
    )
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.logits(loaded(features, tokens, positions)), head16.logits(head16(features, tokens, positions))
        )
    assert torch.equal(loaded.vocab, head.vocab)


def test_missing_and_unexpected_tensors_are_named(target) -> None:
    head, config, _ = random_head(target)
    tensors = dict(head.state_dict())
    del tensors["midlayer.hidden_norm.weight"]
    tensors["layers.0.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['midlayer.hidden_norm.weight'\], unexpected \['layers.0.extra'\]"):
        build_eagle3(config, target.get_input_embeddings(), tensors)


@pytest.mark.parametrize("flag", ["norm_output", "norm_before_residual", "norm_before_fc", "fc_norm"])
def test_speculators_flags_change_the_math_and_the_names(target, flag) -> None:
    plain, _, _ = random_head(target)
    head, _, _ = random_head(target, **{flag: True})
    names = set(head.state_dict()) - set(plain.state_dict())
    assert names == {"norm_before_fc": {"input_norm.weight"}, "fc_norm": {f"fc_norm.{i}.weight" for i in range(3)}}.get(
        flag, set()
    )
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name in names:
                p.uniform_(0.5, 1.5)
        features, tokens, positions = torch.randn(1, 3, 3 * H), torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
        a, b = plain(features, tokens, positions), head(features, tokens, positions)
        if flag == "norm_output":  # the fed-back feature is RMSNorm(o); logits do not normalise twice
            torch.testing.assert_close(b, plain.norm(a))
            torch.testing.assert_close(head.logits(b), plain.logits(a))
        else:
            assert not torch.allclose(plain.logits(a), head.logits(b))
