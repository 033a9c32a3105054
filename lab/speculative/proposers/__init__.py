"""Proposers, one file each: prompt lookup, draft model, self-draft, Medusa heads, MTPC circuit, EAGLE head, and
SSD's speculator (a schedule of the chain loop over any chain proposer).

`make_chain_proposer` builds the chain drafter a strategy names; `cached_heads` loads a trained head set once per
model, dtype and path (shipped heads when the path is empty)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab.engine.models import LoadedModel, validate_model_spec
from lab.heads.common import load_heads
from lab.params import InputError
from lab.speculative.draft import Proposer
from lab.speculative.proposers.draft_model import ModelProposer, check_same_tokenizer, load_draft_model
from lab.speculative.proposers.prompt_lookup import PromptLookupProposer
from lab.speculative.proposers.self_draft import self_draft_proposer

DRAFTERS = ("prompt-lookup", "self-draft", "model")
_HEADS: dict[tuple, Any] = {}
MAX_CACHED_HEADS = 4


def make_chain_proposer(
    target: LoadedModel,
    drafter: str,
    *,
    draft_model: str = "",
    draft_layers: int = 8,
    max_ngram: int = 3,
    lookup_scaling: bool = False,
) -> Proposer:
    """The chain drafter called `drafter`: prompt-lookup (max_ngram), self-draft (the target's first draft_layers
    layers) or model (draft_model by id or path; empty = the target itself, an always-right drafter)."""
    if drafter == "prompt-lookup":
        return PromptLookupProposer(max_ngram, scaled=lookup_scaling)
    if drafter == "self-draft":
        return self_draft_proposer(target, draft_layers)
    if drafter == "model":
        spec = validate_model_spec(draft_model) if draft_model.strip() else target.spec
        draft = target if spec == target.spec else load_draft_model(target, spec)
        return ModelProposer(draft, target.vocab_size, name=f"model {spec}")
    raise InputError(f"Unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}.")


def cached_heads(kind: str, loaded: LoadedModel, path: str, build: Callable[[dict, dict], Any]) -> Any:
    """Load a head set once per (kind, model, dtype, path); `build(tensors, config)` makes the inference object."""
    key = (kind, loaded.spec, id(loaded.model), str(loaded.dtype), path)
    if key not in _HEADS:
        if len(_HEADS) >= MAX_CACHED_HEADS:
            _HEADS.pop(next(iter(_HEADS)))
        _HEADS[key] = build(*load_heads(kind, loaded, path or None))
    return _HEADS[key]


__all__ = [
    "DRAFTERS",
    "ModelProposer",
    "PromptLookupProposer",
    "cached_heads",
    "check_same_tokenizer",
    "load_draft_model",
    "make_chain_proposer",
]
