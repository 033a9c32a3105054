"""Speculative decoding building blocks (DESIGN.md section 6): proposers (drafters) and the chain verifier.

- `base`: `DraftContext` (what a drafter sees), `Draft` (tokens, q_draft or None, tree), the `Proposer` protocol.
- `prompt_lookup`: the deterministic n-gram drafter (q = None).
- `model`: a separate causal LM sharing the target's tokenizer, and the target's first L layers (self-draft).
- `verifier`: one target forward over a chain draft plus `lab.sampling.accept_draft`, with KV rollback.
`make_proposer` builds the drafter a strategy asks for by name. Vanilla speculative decoding
(`strategies.speculative`) and later methods (SSD) share these; they differ in scheduling, not here.
"""

from __future__ import annotations

from lab.models import LoadedModel
from lab.params import InputError
from lab.proposers.base import Draft, DraftContext, Proposer, common_prefix_length
from lab.proposers.model import ModelProposer, check_same_tokenizer, load_draft_model, self_draft_view
from lab.proposers.prompt_lookup import PromptLookupProposer, lookup, lookup_match
from lab.proposers.verifier import Verification, process_rows, verify_draft
from lab.validation import validate_model_spec

DRAFTERS = ("prompt-lookup", "self-draft", "model")


def make_proposer(
    target: LoadedModel,
    drafter: str,
    *,
    draft_model: str = "",
    draft_layers: int = 8,
    max_ngram: int = 3,
    lookup_scaling: bool = False,
) -> Proposer:
    """The proposer called `drafter`: prompt-lookup (max_ngram), self-draft (the target's first draft_layers
    layers) or model (draft_model by id or path; empty = the target itself, an always-right drafter)."""
    if drafter == "prompt-lookup":
        return PromptLookupProposer(max_ngram, scaled=lookup_scaling)
    if drafter == "self-draft":
        return ModelProposer(
            self_draft_view(target, draft_layers), target.vocab_size, name=f"self-draft L={draft_layers}"
        )
    if drafter == "model":
        spec = validate_model_spec(draft_model) if draft_model.strip() else target.spec
        draft = target if spec == target.spec else load_draft_model(target, spec)
        return ModelProposer(draft, target.vocab_size, name=f"model {spec}")
    raise InputError(f"Unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}.")


__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftContext",
    "ModelProposer",
    "PromptLookupProposer",
    "Proposer",
    "Verification",
    "check_same_tokenizer",
    "common_prefix_length",
    "load_draft_model",
    "lookup",
    "lookup_match",
    "make_proposer",
    "process_rows",
    "self_draft_view",
    "verify_draft",
]
