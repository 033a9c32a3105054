"""Self-drafting: the target's own first L decoder layers + final norm + LM head draft for it (as in Draft & Verify,
Zhang et al. 2024, and LayerSkip, Elhoushi et al. 2024, without their training).

`self_draft_view(target, L)` is a shallow copy of the target that shares every parameter (embeddings, the first L
decoder layers, the final norm, the LM head) and has `num_hidden_layers = L`, so it gets its own L-layer KV cache;
`self_draft_proposer` drafts with it through `ModelProposer` (autoregressive, Leviathan et al. 2023, Alg. 1, M_q).
Not covered: sharing the target's KV cache for the first L layers (LayerSkip's cache reuse), trained early exits.
"""

from __future__ import annotations

import copy

from torch import nn

from lab.engine.models import LoadedModel, wrap_model
from lab.params import InputError
from lab.speculative.proposers.draft_model import ModelProposer


def self_draft_view(target: LoadedModel, n_layers: int) -> LoadedModel:
    """The target's first `n_layers` decoder layers + final norm + LM head as a model of its own (shared
    parameters, nothing copied but the module containers and the config)."""
    total = target.num_layers
    if not 1 <= n_layers <= total:
        raise InputError(f"draft_layers = {n_layers} must be between 1 and the target's {total} layers.")
    decoder = target.model.get_decoder()
    name = next((key for key, module in target.model._modules.items() if module is decoder), None)
    if name is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise InputError(f"self-draft needs a decoder-only LM with a `layers` list; {target.spec!r} differs.")
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    view_decoder = copy.copy(decoder)  # shallow: same parameters, buffers and submodules
    view_decoder._modules = dict(decoder._modules)
    view_decoder.layers = nn.ModuleList(list(decoder.layers)[:n_layers])
    view_decoder.config = config
    view = copy.copy(target.model)
    view._modules = dict(target.model._modules)
    setattr(view, name, view_decoder)
    view.config = config
    return wrap_model(view, target.tokenizer, spec=f"{target.spec}[:{n_layers}]")


def self_draft_proposer(target: LoadedModel, n_layers: int) -> ModelProposer:
    """A drafter made of the target's first `n_layers` layers."""
    return ModelProposer(self_draft_view(target, n_layers), target.vocab_size, name=f"self-draft L={n_layers}")
