"""The EAGLE-3 draft head (Li et al. 2025, EAGLE-3, Sec. 3) in the published SafeAILab/EAGLE layout.

EAGLE-3 drafts tokens, not features, from a fusion of the target's low, middle and high features. With
l_p, m_p, h_p the inputs of target layers a < b < c at position p (HF `hidden_states[a]`, ...; by default
a, b, c = 2, L // 2, L - 3 as in SafeAILab's modeling_llama_kv.py, or `eagle_aux_hidden_state_layer_ids`)
    g_p = FC([l_p; m_p; h_p])                                    (EAGLE-3, Sec. 3.2: 3k -> k, no bias)
and for the pair (g_p, x_{p+1}) one decoder layer whose attention reads 2H inputs:
    a_p   = [RMSNorm_in(e(x_{p+1})); RMSNorm_hidden(g_p)]         (`midlayer.input_layernorm`, `hidden_norm`)
    u_p   = g_p + Attn(a_p)                                      (q/k/v_proj: 2H -> heads, o_proj -> H)
    o_p   = u_p + MLP(RMSNorm_post(u_p))
    q(x_{p+2}) = softmax(W_d RMSNorm(o_p))                        (`norm`, `lm_head`: H -> V_d)
Deeper draft steps feed o_p back in place of g_p (training-time test, Sec. 3.1): the head's own output skips
`fc`. `forward(..., fused=...)` says which kind of features it is given (None: told apart by their width,
3 H_t for target features, H for the head's own). Draft index i is target token i + d2t[i]; t2d[v] marks the
target tokens the draft vocabulary holds.

State-dict names are exactly SafeAILab's `eagle/model/cnets.py` (`fc.weight`, `midlayer.self_attn.*`,
`midlayer.mlp.*`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d`), so a head saved by `save_eagle3` is a SafeAILab checkpoint folder
(config.json + model.safetensors) and a published one loads without renaming. The token embedding is the
target's (kept out of the state dict, as SafeAILab loads it from the base model) unless one is passed in.
Options of the `speculators` format are supported as flags on the config: `norm_before_residual`,
`norm_output` (feed back RMSNorm(o_p)), `norm_before_fc` (`input_norm` over the 3H_t concatenation) and
`fc_norm` (one RMSNorm per fused feature); `fc_bias` covers older exports with a biased `fc`.
Not covered: more than one draft decoder layer, Qwen3-style q/k norms inside the draft layer, sliding windows.
`EagleCache` (lab.heads.eagle) drives this head unchanged: `extend` gets fused target features, `tree_step`
the head's own outputs. A folder written by `save_eagle3` loads through `heads_path` (lab.heads.published_build)
with the whole prompt as context, or from the last prompt position if its config has `"lab_context": "last"`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from lab.engine import native_forward
from lab.engine.lean_forward import attention_block, attention_interface, mlp_block

KIND = "eagle3"
FLAGS = ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")


def default_layer_ids(num_layers: int) -> list[int]:
    """SafeAILab's fused layers: the inputs of layers 2, L // 2 and L - 3 (needs L >= 8 to be distinct)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ValueError(f"EAGLE-3's default layers {ids} are not three distinct layers of a {num_layers}-layer model")
    return ids


def fuse_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """[l; m; h]: the inputs of the fused layers (HF hidden_states[i] = input of layer i), concatenated in the
    order given (the head's `layer_ids` are sorted, as vLLM collects them in layer order). [..., 3H]"""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def target_features(head: nn.Module, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """What a draft head reads from a target forward: EAGLE-3 the fused layers, EAGLE-1/2 the last. [T, F]"""
    return fuse_features(hidden_states, list(getattr(head, "feature_layers", (-1,))))


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary given as sorted target ids: d2t[i] = id_i - i, t2d[id_i] = True."""
    draft_ids = draft_ids.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids - torch.arange(draft_ids.numel()), t2d


def head_config(target_config, draft_vocab_size: int, layer_ids: list[int] | None = None, **overrides) -> dict:
    """The config.json of a fresh lab EAGLE-3 head for a target (SafeAILab's keys, plus the fused layer ids)."""
    c = target_config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": int(c.hidden_size), "intermediate_size": int(c.intermediate_size),
        "num_attention_heads": int(c.num_attention_heads),
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
        "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads),
        "hidden_act": str(getattr(c, "hidden_act", "silu")), "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(getattr(c, "max_position_embeddings", 2048)),
        "rope_theta": float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        "vocab_size": int(c.vocab_size), "draft_vocab_size": int(draft_vocab_size), "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids or default_layer_ids(int(c.num_hidden_layers))),
    }  # fmt: skip
    config.update(overrides)
    return config


def layer_config(config: dict) -> LlamaConfig:
    """The head's own transformers config (one layer, SDPA so a boolean 4D mask is passed as is)."""
    known = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")}
    known["num_hidden_layers"] = 1
    layer = LlamaConfig(**known)
    layer._attn_implementation = "sdpa"
    return layer


class Eagle3Layer(nn.Module):
    """SafeAILab's `midlayer`: attention over [norm(e); norm(g)] (2H inputs), residual on g, then the MLP."""

    def __init__(self, config: LlamaConfig, qkv_bias: bool = False) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.self_attn = LlamaAttention(config, layer_idx=0)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=qkv_bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=qkv_bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=qkv_bias)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, mask, cache, rotary) -> torch.Tensor:
        """o = u + MLP(norm(u)), u = g + Attn([norm_in(e); norm_hidden(g)]). [B, T, H]"""
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:  # speculators' option: the residual is the normalised g
            residual = hidden
        attn_in = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)  # [B, T, 2H]
        if cache is not None and not self.training:  # drafting: one call of the op on a low-bit CPU head
            # (lab.engine.native_forward.draft_layer), else the same ops without the modules' dispatch
            out = native_forward.draft_layer(self, residual, attn_in, cache, rotary, mask)
            if out is not None:
                return out
            interface = attention_interface(self.self_attn.config)
            u = residual + attention_block(self.self_attn, attn_in, rotary, mask, cache, interface)
            return u + mlp_block(self.mlp, self.post_attention_layernorm.forward(u))
        attn, _ = self.self_attn(attn_in, position_embeddings=rotary, attention_mask=mask, cache=cache)
        u = residual + attn
        return u + self.mlp(self.post_attention_layernorm(u))


class Eagle3Head(nn.Module):
    """fc over fused target features -> `midlayer` -> o; `logits` = lm_head(norm(o)) over V_d (module docstring).

    `embed` is the token embedding (the target's, frozen and kept out of the state dict)."""

    def __init__(self, config: dict, embed: nn.Module, fc_bias: bool = False, qkv_bias: bool = False) -> None:
        super().__init__()
        self.config = layer_config(config)
        c = self.config
        hidden = int(c.hidden_size)
        self.target_hidden_size = int(config.get("target_hidden_size") or hidden)
        self.layer_ids = sorted(int(i) for i in config["eagle_aux_hidden_state_layer_ids"])
        self.flags = {name: bool(config.get(name, False)) for name in FLAGS}
        fused = len(self.layer_ids) * self.target_hidden_size
        if self.flags["norm_before_fc"]:
            self.input_norm = LlamaRMSNorm(fused, eps=c.rms_norm_eps)
        if self.flags["fc_norm"]:
            self.fc_norm = nn.ModuleList(
                [LlamaRMSNorm(self.target_hidden_size, eps=c.rms_norm_eps) for _ in self.layer_ids]
            )
        self.fc = nn.Linear(fused, hidden, bias=fc_bias)
        self.midlayer = Eagle3Layer(c, qkv_bias)
        self.norm = LlamaRMSNorm(hidden, eps=c.rms_norm_eps)
        draft_vocab = int(config.get("draft_vocab_size") or c.vocab_size)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(int(c.vocab_size), dtype=torch.bool))
        # outside the module tree: not saved, not cast (the rotary frequencies stay float32)
        self._frozen = {"embed": embed, "rotary": LlamaRotaryEmbedding(c)}

    @property
    def draft_vocab_size(self) -> int:
        return int(self.lm_head.out_features)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its output norm's; `EagleCache` casts features to it)."""
        return self.norm.weight.dtype

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states this head reads, in fusion order (indices into HF hidden_states)."""
        return tuple(self.layer_ids)

    @property
    def vocab(self) -> torch.Tensor:
        """Target token id of each draft index: i + d2t[i]. [V_d]"""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """g = FC([l; m; h]) (with the speculators format's optional norms before it). [..., H]"""
        if self.flags["norm_before_fc"]:
            features = self.input_norm(features)
        if self.flags["fc_norm"]:
            chunks = features.split(self.target_hidden_size, dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, 3H_t] fused target features, or [B, T, H] the head's own outputs
        tokens: torch.Tensor,  # [B, T] x_{p+1}
        positions: torch.Tensor,  # [B, T] p
        mask: torch.Tensor | None = None,  # [B, 1, T, past + T] bool, None = causal
        cache=None,  # DynamicCache of the head (EagleCache.cache)
        fused: bool | None = None,  # True: target features (through fc); False: own outputs; None: by width
    ) -> torch.Tensor:
        """o_p for every pair (g_p or o_{p-1}, x_{p+1}); with `norm_output` RMSNorm(o_p). [B, T, H]"""
        if fused is None:
            fused = self._is_fused(features)
        x = self.fuse(features) if fused else features  # [B, T, H]
        embedded = self._frozen["embed"](tokens).to(x.dtype)  # [B, T, H]
        rotary = self._frozen["rotary"](x, positions)
        if mask is None and cache is None and x.shape[1] > 1:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()[None, None]
        out = self.midlayer(embedded, x, mask, cache, rotary)
        return self.norm(out) if self.flags["norm_output"] else out

    def _is_fused(self, features: torch.Tensor) -> bool:
        width = features.shape[-1]
        if width == self.fc.in_features:
            return True
        if width == self.fc.out_features:
            return False
        raise ValueError(
            f"EAGLE-3 features of width {width}: expected {self.fc.in_features} (fused target features) "
            f"or {self.fc.out_features} (the head's own output)"
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over V_d: lm_head(RMSNorm(o)) (the norm is already applied with `norm_output`). [..., V_d]"""
        hidden = hidden.to(self.dtype)  # not lm_head.weight: a low-bit head (`serving_head`) dequantizes on read
        return self.lm_head(hidden if self.flags["norm_output"] else self.norm(hidden))

    def to(self, *args, **kwargs):  # the frozen rotary follows the device, never the dtype
        out = super().to(*args, **kwargs)
        self._frozen["rotary"].to(device=self.norm.weight.device)
        return out


def build_eagle3(
    config: dict, embed: nn.Module, tensors: dict[str, torch.Tensor] | None = None, *, device=None, dtype=None
) -> Eagle3Head:
    """An EAGLE-3 head (fresh, or from SafeAILab-named tensors, checked strictly), on `device` in `dtype`."""
    tensors = tensors or {}
    head = Eagle3Head(config, embed, fc_bias="fc.bias" in tensors, qkv_bias="midlayer.self_attn.q_proj.bias" in tensors)
    if tensors:
        state = {name: t for name, t in tensors.items() if name != "embed_tokens.weight"}
        optional = {"d2t", "t2d"} if head.draft_vocab_size == head.config.vocab_size else set()
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [name for name in missing if name not in optional]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 head tensors do not fit: missing {missing}, unexpected {unexpected}")
    head = head.to(device=device) if device is not None else head
    return (head.to(dtype=dtype) if dtype is not None else head).eval()


def save_eagle3(folder: Path, head: Eagle3Head, config: dict) -> Path:
    """Write a SafeAILab-layout folder: config.json + model.safetensors (floats fp16, d2t int64, t2d bool)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stored = {
        name: (t.detach().to(torch.float16) if t.is_floating_point() else t.detach()).contiguous().cpu()
        for name, t in head.state_dict().items()
    }
    save_file(stored, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}, indent=2, sort_keys=True))
    return folder
