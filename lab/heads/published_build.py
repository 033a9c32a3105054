"""Published heads (lab.heads.published) turned into the lab's heads, on the target's device and dtype.

- SafeAILab EAGLE-1/2 -> `lab.heads.eagle.EagleHead`: `layers.0.*` is the lab's `layer.*` (one decoder layer
  of the target's class without input norm, as SafeAILab's index-0 layer), `fc` reads [e(x); f], the target's
  LM head scores the full vocabulary, the rotary embedding and norm epsilon follow the head's config.json.
  Biases the config says the head has not (`"bias": false` for `fc`, no `qkv_bias` on a target whose layer
  class has q/k/v biases, e.g. Qwen2) are zero. The head's rotary embedding and LM-head rows are set on its
  `_target` dict (the EagleHead's frozen, unsaved pieces); the LM head is the target's own tensor, not a copy.
- SafeAILab EAGLE-3 -> `lab.heads.eagle3.Eagle3Head` with the tensors as they are; the fused layers are
  `eagle_aux_hidden_state_layer_ids` if the config names them, else 2, L // 2, L - 3 of the target.
- speculators EAGLE-3 -> the same head: `layers.0.` becomes `midlayer.`, the decoder config is
  `transformer_layer_config`, and the format's flags (`norm_before_residual`, `norm_output`, ...) carry over.
- FasterDecoding Medusa -> `ResBlockHeads`: head k is medusa_num_layers residual blocks u <- u + SiLU(W u + b)
  followed by its own output layer W_k (Cai et al. 2024, Eq. 1 with a per-head LM head), over the full vocabulary.
The token embedding is the target's (published EAGLE-1 files carry a copy of it, ignored), except for an
EAGLE-3 draft whose hidden size differs from the target's (`target_hidden_size`): it brings `embed_tokens`.
Published heads read the whole prompt as context (`reads_prompt`), as their reference implementations do; a
config key `"lab_context": "last"` (the lab's own heads trained from the last prompt position) turns that off.
Not covered: checkpoints with more than one draft decoder layer, Qwen3-style q/k norms in an EAGLE-3 layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lab.engine.models import LoadedModel
from lab.heads.eagle import EagleHead, build_head
from lab.heads.eagle3 import Eagle3Head, build_eagle3, default_layer_ids
from lab.heads.medusa import tune_choices
from lab.heads.published import Published, check_layer_ids, check_target, load_published, require
from lab.params import InputError

# A generic prior for the candidate tree of heads without tuned accuracies (not measured): P(rank i of draft
# position d is right) = 0.6 * 0.8^d * 0.5^i; `tune_choices` orders paths by the product along them.
PRIOR_TREE = tune_choices([[0.6 * 0.8**d * 0.5**i for i in range(10)] for d in range(5)], max_nodes=64)


def _zero_biases(loaded: LoadedModel, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Zero biases for what the config says the head has not, where the lab's layer (the target's class) has them."""
    attn = loaded.model.get_decoder().layers[0].self_attn
    wanted = [("fc", not config.get("bias", True))]
    wanted += [
        (f"layer.self_attn.{p}_proj", getattr(attn, f"{p}_proj").bias is not None and not config.get("qkv_bias", False))
        for p in ("q", "k", "v")
    ]
    for name, zero in wanted:
        if zero and f"{name}.weight" in tensors and f"{name}.bias" not in tensors:
            tensors[f"{name}.bias"] = torch.zeros(
                tensors[f"{name}.weight"].shape[0], dtype=tensors[f"{name}.weight"].dtype
            )


def eagle_head(loaded: LoadedModel, published: Published) -> EagleHead:
    """SafeAILab EAGLE-1/2 -> EagleHead over the full vocabulary (module docstring)."""
    c = published.config
    check_target(
        published,
        loaded,
        {
            "hidden size": c.get("hidden_size"),
            "vocabulary": c.get("vocab_size"),
            "intermediate size": c.get("intermediate_size"),
            "attention heads": c.get("num_attention_heads"),
            "key/value heads": c.get("num_key_value_heads"),
        },
    )
    if any(n.startswith("layers.") and not n.startswith("layers.0.") for n in published.tensors):
        raise InputError(f"{published.weights} has more than one draft layer; the lab's EAGLE head has one.")
    require(published, ["fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"])
    tensors = {
        ("layer." + n[len("layers.0.") :]) if n.startswith("layers.0.") else n: t
        for n, t in published.tensors.items()
        if n != "embed_tokens.weight"
    }
    _zero_biases(loaded, c, tensors)
    try:
        head = build_head(loaded, torch.arange(loaded.vocab_size), tensors)
    except (ValueError, RuntimeError) as error:
        raise InputError(f"The EAGLE head at {published.weights} does not load: {error}") from None
    layer_config = LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "torch_dtype")})
    head._target["rotary"] = LlamaRotaryEmbedding(layer_config).to(loaded.device)
    head._target["lm_weight"] = loaded.lm_head.weight.detach()  # the full vocabulary: no copy of the LM head
    head.layer.post_attention_layernorm.variance_epsilon = float(c.get("rms_norm_eps", 1e-6))
    head.reads_prompt = reads_prompt(c)
    return head


def speculators_config(published: Published) -> tuple[dict, dict[str, torch.Tensor]]:
    """speculators' config.json + names -> SafeAILab's (transformer_layer_config, flags; layers.0. -> midlayer.)."""
    c = published.config
    layer = dict(c.get("transformer_layer_config") or {})
    if not layer:
        raise InputError(f"{published.folder}/config.json lacks transformer_layer_config.")
    if int(layer.get("num_hidden_layers", 1)) != 1 or any(n.startswith("layers.1.") for n in published.tensors):
        raise InputError(f"{published.weights} has more than one draft layer; the lab's EAGLE-3 head has one.")
    if any(".q_norm." in n for n in published.tensors):
        raise InputError(f"{published.weights} has Qwen3-style q/k norms in its draft layer; not supported yet.")
    config = {**layer, "draft_vocab_size": c.get("draft_vocab_size"), "target_hidden_size": c.get("target_hidden_size")}
    for key in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm", "eagle_aux_hidden_state_layer_ids"):
        if c.get(key) is not None:
            config[key] = c[key]
    tensors = {
        ("midlayer." + n[len("layers.0.") :]) if n.startswith("layers.0.") else n: t
        for n, t in published.tensors.items()
    }
    return config, tensors


def eagle3_head(loaded: LoadedModel, published: Published) -> Eagle3Head:
    """SafeAILab or speculators EAGLE-3 -> Eagle3Head (module docstring)."""
    if published.layout == "speculators-eagle3":
        config, tensors = speculators_config(published)
    else:
        config, tensors = dict(published.config), dict(published.tensors)
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise InputError(f"{published.folder} has {config['num_hidden_layers']} draft layers; the lab's head has one.")
    require(published, ["fc.weight", "lm_head.weight", "norm.weight"])
    ids = config.get("eagle_aux_hidden_state_layer_ids") or _default_ids(published, loaded)
    check_layer_ids(published, loaded, [int(i) for i in ids])
    check_target(
        published,
        loaded,
        {
            "hidden size": config.get("target_hidden_size") or config.get("hidden_size"),
            "vocabulary": config.get("vocab_size") or (tensors["t2d"].numel() if "t2d" in tensors else None),
        },
    )
    config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in ids]
    embed = loaded.embeddings
    if int(config.get("hidden_size", 0)) != int(loaded.config.hidden_size):  # a draft narrower than the target
        require(published, ["embed_tokens.weight"])  # brings its own embedding
        embed = torch.nn.Embedding.from_pretrained(tensors["embed_tokens.weight"].to(loaded.device, loaded.dtype))
    try:
        head = build_eagle3(config, embed, tensors, device=loaded.device, dtype=loaded.dtype)
    except (ValueError, RuntimeError, TypeError) as error:
        raise InputError(f"The EAGLE-3 head at {published.weights} does not load: {error}") from None
    head.reads_prompt = reads_prompt(config)
    return head


def reads_prompt(config: dict) -> bool:
    """Whole-prompt context (the references' way) unless the config says `"lab_context": "last"` (a lab head
    trained, like the lab's EAGLE-1 head, from the last prompt position on)."""
    return config.get("lab_context", "prompt") != "last"


def _default_ids(published: Published, loaded: LoadedModel) -> list[int]:
    try:
        return default_layer_ids(loaded.num_layers)
    except ValueError as error:
        raise InputError(f"{published.folder} names no eagle_aux_hidden_state_layer_ids and {error}.") from None


@dataclass
class ResBlockHeads:
    """FasterDecoding Medusa heads: per head, residual blocks then its own output layer (module docstring)."""

    weight: torch.Tensor  # [K, R, H, H] residual block weights (R = medusa_num_layers)
    bias: torch.Tensor  # [K, R, H]
    lm_weight: torch.Tensor  # [K, V, H] each head's own output layer
    vocab: torch.Tensor  # [V] identity: the heads score the full vocabulary
    choices: list[tuple[int, ...]] = field(default_factory=lambda: list(PRIOR_TREE))

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @torch.inference_mode()
    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """p^(k) for each head k from the last hidden state: h [H] -> [K, V] (float32)."""
        u = h.to(self.weight.dtype)[None].expand(self.num_heads, -1)  # [K, H]
        for r in range(self.weight.shape[1]):
            u = u + torch.nn.functional.silu(torch.einsum("kh,kgh->kg", u, self.weight[:, r]) + self.bias[:, r])
        return torch.softmax(torch.einsum("kh,kvh->kv", u, self.lm_weight).float(), dim=-1)


def medusa_heads(loaded: LoadedModel, published: Published) -> ResBlockHeads:
    """FasterDecoding's `{k}.{r}.linear.{weight,bias}` and `{k}.{R}.weight` -> ResBlockHeads."""
    c = published.config
    if "medusa_num_heads" not in c:
        raise InputError(f"{published.folder}/config.json lacks medusa_num_heads (FasterDecoding's Medusa config).")
    k_heads, layers = int(c["medusa_num_heads"]), int(c.get("medusa_num_layers", 1))
    names = [f"{k}.{r}.linear.{p}" for k in range(k_heads) for r in range(layers) for p in ("weight", "bias")]
    require(published, names + [f"{k}.{layers}.weight" for k in range(k_heads)])
    t = published.tensors
    hidden, vocab = t["0.0.linear.weight"].shape[1], t[f"0.{layers}.weight"].shape[0]
    check_target(published, loaded, {"hidden size": hidden, "vocabulary": vocab})
    dev, dt = loaded.device, loaded.dtype
    try:
        weight = torch.stack(
            [torch.stack([t[f"{k}.{r}.linear.weight"] for r in range(layers)]) for k in range(k_heads)]
        )
        bias = torch.stack([torch.stack([t[f"{k}.{r}.linear.bias"] for r in range(layers)]) for k in range(k_heads)])
        lm = torch.stack([t[f"{k}.{layers}.weight"] for k in range(k_heads)])
    except RuntimeError as error:
        raise InputError(f"The Medusa heads at {published.weights} have inconsistent shapes: {error}") from None
    return ResBlockHeads(weight.to(dev, dt), bias.to(dev, dt), lm.to(dev, dt), torch.arange(vocab, device=dev))


def load_eagle(loaded: LoadedModel, path: str) -> EagleHead | Eagle3Head:
    """The EAGLE-1/2 or EAGLE-3 head at `path` (folder or Hub id), checked against `loaded`."""
    published = load_published(path)
    if published.layout == "eagle":
        return eagle_head(loaded, published)
    if published.layout in ("eagle3", "speculators-eagle3"):
        return eagle3_head(loaded, published)
    raise InputError(f"{published.folder} holds {published.layout} heads; the EAGLE strategy needs an EAGLE head.")


def load_medusa(loaded: LoadedModel, path: str) -> ResBlockHeads:
    """The FasterDecoding Medusa heads at `path` (folder or Hub id), checked against `loaded`."""
    published = load_published(path)
    if published.layout != "medusa":
        raise InputError(f"{published.folder} holds {published.layout} heads; the Medusa strategy needs Medusa heads.")
    return medusa_heads(loaded, published)


_CACHE: dict[tuple, object] = {}


def cached(kind: str, loaded: LoadedModel, path: str):
    """`load_eagle` / `load_medusa` once per (kind, model, dtype, path); the four most recent stay loaded."""
    key = (kind, loaded.spec, id(loaded.model), str(loaded.dtype), path)
    if key not in _CACHE:
        if len(_CACHE) >= 4:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (load_eagle if kind == "eagle" else load_medusa)(loaded, path)
    return _CACHE[key]
