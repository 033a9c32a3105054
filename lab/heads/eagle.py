"""The EAGLE draft head (Li et al. 2024, EAGLE, Sec. 4.1) and its KV cache over real pairs and a draft tree.

EAGLE drafts at the feature level. With f_p the target's feature at position p (its last hidden state after the
final norm, i.e. the LM head's input) and x_{p+1} the token that followed, the head predicts the next feature
    f_hat_{p+1} = Layer(FC([e(x_{p+1}); f_p]))                                    (EAGLE, Sec. 4.1, Fig. 6)
with e the target's frozen token embedding, FC a linear map 2H -> H (with bias, as EAGLE's `fc`) and Layer one
decoder layer of the target's own architecture (its class is taken from the target, so Llama, Qwen2, ... all
work; EAGLE-1 drops that layer's input norm, and so do we). The target's frozen LM head turns f_hat into the
draft distribution q(x_{p+2}) = softmax(W_lm[V_d] f_hat_{p+1}), a softmax over V_d only, a frequency-ranked draft
vocabulary (FR-Spec / EAGLE-3 style; `lab.heads.common.draft_vocabulary`): scoring 8k rows instead of 49k is
what makes a draft step cheap on a CPU. Verification always scores the full vocabulary, so outputs stay exact.
On a CPU target with low-bit weights (int8 / int4 / w4a8) the strategy runs the head at the target's precision
(`serving_head`: fc and the layer through the same low-bit kernels, the draft logits through the low-bit rows V_d of
the target's LM head; an EAGLE-3 head's own draft LM head in the target's LM-head format); trained and saved heads
stay float.

`EagleCache` is the head's own KV cache. Its first `committed` entries are real pairs (f_p, x_{p+1}) whose
feature came from the target; draft-tree entries (pairs whose feature is the head's own prediction) are appended
after them with a tree mask and dropped by `rollback` once the round is verified. EAGLE's reference
implementation does the same: after verification it re-runs the head on the accepted tokens with the target's
real features instead of keeping the draft entries, so "compacting" the head's cache is a crop plus a chain
`extend` of the accepted path.

Deliberate differences from the paper:
- the head's context starts at the last prompt position (the first pair is (f_last_prompt, x_first_response)),
  exactly what the self-distillation data stores (`lab.training.distill`), instead of covering the whole prompt;
- draft vocabulary V_d (above) instead of the full vocabulary (EAGLE-1) or a trained one (EAGLE-3).
Not covered: EAGLE-3's multi-layer feature fusion and training-time test, batching several sequences.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lab.engine import native_forward
from lab.engine.lean_forward import attention_interface, layer_forward
from lab.engine.models import LoadedModel
from lab.engine.quant import Int8Linear, W8A8Linear, quantize_linears, quantized_head
from lab.heads.eagle3 import Eagle3Head

KIND = "eagle"


def _layer_config(loaded: LoadedModel):
    """The target's config for a one-layer stack with SDPA attention (a boolean 4D mask is passed as is)."""
    config = copy.deepcopy(loaded.config)
    config.num_hidden_layers = 1
    config._attn_implementation = "sdpa"
    return config


class EagleHead(nn.Module):
    """FC over [e(x_{p+1}); f_p] -> one decoder layer -> f_hat_{p+1}; `logits` applies the LM head rows V_d.

    The target's embedding, rotary embedding and LM head are used, never trained or saved: only `fc.*`,
    `layer.*` and the `vocab` buffer are in the state dict."""

    def __init__(self, loaded: LoadedModel, vocab: torch.Tensor) -> None:
        super().__init__()
        config = _layer_config(loaded)
        hidden = int(config.hidden_size)
        decoder = loaded.model.get_decoder()
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = type(decoder.layers[0])(config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE-1: the draft layer has no input norm
        self.register_buffer("vocab", vocab.long().clone())
        self.config = config
        # frozen pieces of the target, kept out of the module tree (not parameters, not saved)
        lm_weight = loaded.lm_head.weight.detach().index_select(0, vocab.long().to(loaded.device))
        self._target = {"embed": loaded.embeddings, "rotary": decoder.rotary_emb, "lm_weight": lm_weight}

    @property
    def draft_vocab_size(self) -> int:
        return int(self.vocab.numel())

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its layer norm's, which no quantization replaces)."""
        return self.layer.post_attention_layernorm.weight.dtype

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] f_p
        tokens: torch.Tensor,  # [B, T] x_{p+1}
        positions: torch.Tensor,  # [B, T] p
        mask: torch.Tensor | None = None,  # [B, 1, T, past + T] bool, None = causal
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """f_hat_{p+1} for every pair (EAGLE Sec. 4.1): [B, T, H]."""
        embedded = self._target["embed"](tokens).to(features.dtype)  # [B, T, H]
        x = self.fc(torch.cat([embedded, features], dim=-1))  # [B, T, H]
        rotary = self._target["rotary"](x, positions)
        if mask is None and cache is None and x.shape[1] > 1:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()[None, None]
        if cache is not None and not self.training and type(self.layer) is LlamaDecoderLayer:  # drafting: the
            # layer as one call of the op on a low-bit CPU head (lab.engine.native_forward.draft_layer; no input norm:
            # q / k / v read x itself), else the same ops as the module call without its dispatch
            # (lab.engine.lean_forward; other targets' layer classes keep their own forward)
            if type(self.layer.input_layernorm) is nn.Identity:
                out = native_forward.draft_layer(self.layer, x, x, cache, rotary, mask)
                if out is not None:
                    return out
            return layer_forward(self.layer, x, rotary, mask, cache, attention_interface(self.config))
        out = self.layer(
            x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
            position_embeddings=rotary,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits over V_d: W_lm[V_d] f_hat (the target's frozen LM head rows). [..., V_d]"""
        rows = self._target.get("lm_rows")  # the low-bit rows of `serving_head`
        if rows is not None:
            return rows(features)
        weight = self._target["lm_weight"]
        return features.to(weight.dtype) @ weight.T


def build_head(loaded: LoadedModel, vocab: torch.Tensor, tensors: dict[str, torch.Tensor] | None = None) -> EagleHead:
    """An EAGLE head for `loaded` over draft vocabulary `vocab` (fresh or from saved tensors), in its dtype."""
    head = EagleHead(loaded, vocab)
    if tensors is not None:
        state = {name: t for name, t in tensors.items() if name != "vocab"}
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [name for name in missing if name != "vocab"]
        if missing or unexpected:
            raise ValueError(f"EAGLE head tensors do not fit: missing {missing}, unexpected {unexpected}")
    return head.to(device=loaded.device, dtype=loaded.dtype).eval()


def serving_head(head: EagleHead | Eagle3Head, loaded: LoadedModel) -> EagleHead | Eagle3Head:
    """The head as the strategy runs it. For a CPU target whose linears are low-bit (int8 / int4 with its int8 LM
    head, w4a8 with its Q8_0 one), the head's fc and decoder layer take the target's precision and its draft logits
    the rows V_d of the target's LM head (EAGLE-1: it has no LM head of its own) or its own LM head in the target's
    LM-head format (EAGLE-3), so each draft step runs the target's row-efficient low-bit kernels instead of float
    products: the draft distribution changes by the weights' rounding (as the target's does at that precision);
    verification, and so the output, does not. Other targets keep the head as built. In place (a head already
    served is left as it is); returns it."""
    if loaded.device.type != "cpu" or loaded.precision not in ("int8", "int4", "w4a8"):
        return head
    if isinstance(head, Eagle3Head):
        if type(head.lm_head) is nn.Linear:  # first, so the next line leaves it alone
            head.lm_head = quantized_head(head.lm_head, loaded.precision, loaded.dtype)
        quantize_linears(head, loaded.precision, loaded.dtype)  # fc and the layer's linears
        return head
    lm_head = loaded.lm_head
    if type(lm_head) not in (Int8Linear, W8A8Linear) or head.draft_vocab_size == loaded.vocab_size:
        return head
    quantize_linears(head, loaded.precision, loaded.dtype)
    head._target["lm_rows"] = type(lm_head).rows(lm_head, head.vocab)
    return head


def head_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """What `save_heads` stores: fc.*, layer.* (fp16 on disk) and the int64 draft vocabulary."""
    return {name: t.detach().cpu() for name, t in head.state_dict().items()}


class EagleCache:
    """The head's KV cache: `committed` real pairs, then this round's draft-tree entries (see module docstring).

    `tree_nodes[j]` is the draft-tree node whose pair sits at cache entry committed + j; `ancestors` gives each
    tree node's ancestor set so a new tree entry attends to the committed pairs, its ancestors and itself."""

    def __init__(self, head: EagleHead) -> None:
        self.head = head
        self.cache = DynamicCache(config=head.config)
        self.committed = 0
        self.tree_nodes: list[int] = []

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, tokens: list[int], first_position: int) -> torch.Tensor:
        """Append real pairs (f_p, x_{p+1}), p = first_position.., causally; returns f_hat of the last: [H]."""
        self.rollback()
        device = features.device
        n = len(tokens)
        positions = torch.arange(first_position, first_position + n, device=device)[None]  # [1, n]
        mask = None
        if n > 1 or self.committed:
            mask = torch.ones(n, self.committed + n, dtype=torch.bool, device=device).tril(self.committed)[None, None]
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        out = self.head(features[None].to(self.head.dtype), ids, positions, mask, self.cache)  # [1, n, H]
        self.committed += n
        return out[0, -1]

    @torch.inference_mode()
    def tree_step(
        self,
        features: torch.Tensor,  # [k, H] f_hat of each node's parent
        tokens: list[int],  # [k] the nodes' tokens
        positions: list[int],  # [k]
        nodes: list[int],  # [k] node ids of the tree being grown
        ancestors: list[set[int]],  # [k] ancestor node ids of each node (itself excluded)
    ) -> torch.Tensor:
        """Run the head on k draft-tree nodes at once with the tree mask; returns their f_hat: [k, H]."""
        device, k = features.device, len(tokens)
        known = self.tree_nodes + list(nodes)
        tree_mask = torch.tensor([[j in ancestors[i] or j == node for j in known] for i, node in enumerate(nodes)])
        mask = torch.cat([torch.ones(k, self.committed, dtype=torch.bool), tree_mask], dim=1)[None, None]
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        pos = torch.tensor([positions], dtype=torch.long, device=device)
        out = self.head(features[None], ids, pos, mask.to(device), self.cache)  # [1, k, H]
        self.tree_nodes.extend(nodes)
        return out[0]

    def rollback(self) -> None:
        """Forget the draft-tree entries; keep the committed real pairs."""
        if self.tree_nodes:
            self.cache.crop(-len(self.tree_nodes))  # transformers 5.x: crop(-n) drops the last n entries
            self.tree_nodes = []

    def reset(self) -> None:
        self.cache.reset()
        self.committed, self.tree_nodes = 0, []
