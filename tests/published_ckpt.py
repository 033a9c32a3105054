"""Tiny checkpoints in the published head layouts, written in code (pure torch: the same bytes in any venv).

`write(layout, folder, dims, seed, target=...)` writes exactly the files, tensor names, dtypes and config keys of
- "eagle": SafeAILab EAGLE-1/2 (config.json + pytorch_model.bin: embed_tokens copy, fc [H, 2H] + bias,
  layers.0.* without input_layernorm; q/k/v biases when `qkv_bias`, as EAGLE-Qwen2 heads);
- "eagle3": SafeAILab EAGLE-3 (config.json + pytorch_model.bin: fc [H, 3H] no bias, midlayer.*, norm, lm_head
  [V_d, H], d2t int64, t2d bool);
- "speculators-eagle3": vLLM's speculators format (config.json with speculators_config and
  transformer_layer_config + model.safetensors: layers.0.*, embed_tokens, d2t, t2d);
- "medusa": FasterDecoding (config.json with medusa_num_heads / medusa_num_layers + medusa_lm_head.pt or
  .safetensors: `{k}.{r}.linear.weight/bias`, `{k}.{R}.weight` [V, H]).
Used by tests/test_published.py and by scripts/make_head_goldens.py (the reference implementations' venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

DIMS = {"hidden": 32, "intermediate": 64, "heads": 4, "kv_heads": 2, "vocab": 256, "layers": 8, "draft_vocab": 48}


def _rand(g: torch.Generator, *shape: int, scale: float = 0.1) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(torch.float16)


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.2 * torch.rand(n, generator=g) - 0.1).to(torch.float16)


def _attention(g, prefix: str, d: dict, inputs: int, qkv_bias: bool) -> dict[str, torch.Tensor]:
    h, hd = d["hidden"], d["hidden"] // d["heads"]
    out = {
        f"{prefix}self_attn.q_proj.weight": _rand(g, d["heads"] * hd, inputs),
        f"{prefix}self_attn.k_proj.weight": _rand(g, d["kv_heads"] * hd, inputs),
        f"{prefix}self_attn.v_proj.weight": _rand(g, d["kv_heads"] * hd, inputs),
        f"{prefix}self_attn.o_proj.weight": _rand(g, h, d["heads"] * hd),
        f"{prefix}mlp.gate_proj.weight": _rand(g, d["intermediate"], h),
        f"{prefix}mlp.up_proj.weight": _rand(g, d["intermediate"], h),
        f"{prefix}mlp.down_proj.weight": _rand(g, h, d["intermediate"]),
        f"{prefix}post_attention_layernorm.weight": _norm(g, h),
    }
    if qkv_bias:
        for p in ("q", "k", "v"):
            out[f"{prefix}self_attn.{p}_proj.bias"] = _rand(g, out[f"{prefix}self_attn.{p}_proj.weight"].shape[0])
    return out


def llama_config(d: dict, **extra) -> dict:
    """The Llama keys SafeAILab's configs carry (EConfig / LlamaConfig)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": d["hidden"],
        "intermediate_size": d["intermediate"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "num_hidden_layers": 1,
        "vocab_size": d["vocab"],
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        **extra,
    }


def draft_ids(d: dict, seed: int) -> torch.Tensor:
    """A sorted draft vocabulary (always holding token 0, the tiny models' EOS)."""
    g = torch.Generator().manual_seed(seed + 7)
    rest = torch.randperm(d["vocab"] - 1, generator=g)[: d["draft_vocab"] - 1] + 1
    return torch.sort(torch.cat([torch.zeros(1, dtype=torch.long), rest])).values


def eagle3_tensors(d: dict, seed: int, prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = d["hidden"]
    tensors = {"fc.weight": _rand(g, h, 3 * h), **_attention(g, prefix, d, 2 * h, False)}
    tensors[f"{prefix}input_layernorm.weight"] = _norm(g, h)
    tensors[f"{prefix}hidden_norm.weight"] = _norm(g, h)
    tensors["norm.weight"] = _norm(g, h)
    tensors["lm_head.weight"] = _rand(g, d["draft_vocab"], h, scale=0.5)
    ids = draft_ids(d, seed)
    tensors["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(d["vocab"], dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def eagle_tensors(d: dict, seed: int, embed: torch.Tensor, qkv_bias: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = d["hidden"]
    tensors = {"embed_tokens.weight": embed.to(torch.float16).clone(), "fc.weight": _rand(g, h, 2 * h)}
    tensors["fc.bias"] = _rand(g, h)
    tensors.update(_attention(g, "layers.0.", d, h, qkv_bias))
    return tensors


def medusa_tensors(d: dict, seed: int, heads: int, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, out = d["hidden"], {}
    for k in range(heads):
        for r in range(layers):
            out[f"{k}.{r}.linear.weight"] = _rand(g, h, h, scale=0.3)
            out[f"{k}.{r}.linear.bias"] = _rand(g, h)
        out[f"{k}.{layers}.weight"] = _rand(g, d["vocab"], h, scale=0.5)
    return out


def speculators_config(d: dict, layer_ids: list[int] | None) -> dict:
    """The config.json speculators 0.9 writes for an Eagle3DraftModel (checked by scripts/make_head_goldens.py)."""
    layer = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 0,
        "head_dim": d["hidden"] // d["heads"],
        "hidden_act": "silu",
        "hidden_size": d["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": d["intermediate"],
        "max_position_embeddings": 512,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": d["heads"],
        "num_hidden_layers": 1,
        "num_key_value_heads": d["kv_heads"],
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": d["vocab"],
    }
    proposal = {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
    return {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": d["draft_vocab"],
        "dtype": "float16",
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [proposal],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": "5.19.0",
    }


def write(
    layout: str,
    folder: Path,
    d: dict = DIMS,
    seed: int = 0,
    *,
    embed: torch.Tensor | None = None,
    qkv_bias: bool = False,
    layer_ids: list[int] | None = None,
    pickle: bool = True,
    medusa_heads: int = 3,
    medusa_layers: int = 1,
) -> Path:
    """Write one checkpoint folder in `layout` (module docstring); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "eagle":
        config = llama_config(d, bias=True, **({"qkv_bias": True} if qkv_bias else {}))
        tensors = eagle_tensors(d, seed, embed if embed is not None else torch.zeros(d["vocab"], d["hidden"]), qkv_bias)
        weights = "pytorch_model.bin" if pickle else "model.safetensors"
    elif layout == "eagle3":
        config = llama_config(d, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=d["draft_vocab"])
        if layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = layer_ids
        tensors, weights = eagle3_tensors(d, seed), "pytorch_model.bin" if pickle else "model.safetensors"
    elif layout == "speculators-eagle3":
        config = speculators_config(d, layer_ids)
        tensors = eagle3_tensors(d, seed, prefix="layers.0.")
        if embed is not None:
            tensors["embed_tokens.weight"] = embed.to(torch.float16).clone()
        weights = "model.safetensors"
    elif layout == "medusa":
        config = {
            "medusa_num_heads": medusa_heads,
            "medusa_num_layers": medusa_layers,
            "base_model_name_or_path": "tiny",
            "architectures": ["MedusaModel"],
        }
        tensors = medusa_tensors(d, seed, medusa_heads, medusa_layers)
        weights = "medusa_lm_head.pt" if pickle else "medusa_lm_head.safetensors"
    else:
        raise ValueError(layout)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / weights))
    else:
        torch.save(tensors, str(folder / weights))
    return folder


def golden_target(d: dict = DIMS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The target pieces a head reads, fp16-exact: token embedding and LM head weights [V, H] each (float32)."""
    g = torch.Generator().manual_seed(seed + 100)
    embed = (torch.randn(d["vocab"], d["hidden"], generator=g) * 0.5).half().float()
    lm = (torch.randn(d["vocab"], d["hidden"], generator=g) * 0.5).half().float()
    return embed, lm


def golden_inputs(width: int, d: dict = DIMS, seed: int = 0, length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [T, width] (the target's, fp16-exact) and the tokens x_{p+1} paired with them [T]."""
    g = torch.Generator().manual_seed(seed + 200)
    features = torch.randn(length, width, generator=g).half().float()
    return features, torch.randint(1, d["vocab"], (length,), generator=g)
