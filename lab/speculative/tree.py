"""The tree loop: draft a tree (Medusa heads, MTPC's circuit, EAGLE's head), verify it in one target forward with
the tree attention mask, accept a root-to-node path, compact the KV cache, stream. A chain is a tree too: MTPC's
sampled chains go through the same loop (verified causally, accepted with Leviathan et al.'s rule).

Each round: 1. the proposer drafts from what it learnt of the last round (the target's features at the accepted
positions, `Verified`); 2. `lab.speculative.verify` scores [root] + nodes in one forward (tree mask, position ids
n_past + depth); 3. the acceptance rule picks the path and the next token: greedy (exact), sample (lossless:
the sibling rule, or Alg. 1 for a sampled chain) or typical (Medusa's, lossy); 4. `commit` keeps the prefix, the
root and the path in the cache; 5. the proposer's detail events, a TreeRound and one TokenEmitted per token
stream out; the next token becomes the root. The first token comes from the prefill forward, as in greedy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine import runtime
from lab.engine.emitter import Emitter
from lab.engine.models import LoadedModel
from lab.engine.profile import section
from lab.engine.sampling import SamplingConfig, choose_token, process_logits
from lab.speculative.acceptance import accept
from lab.speculative.draft import DraftContext, Proposer, Verified
from lab.speculative.events import sources_of, tree_round
from lab.speculative.verify import commit, features_of, path_rows, verify
from lab.trace import Event, RunFinished


@dataclass(frozen=True)
class TreeSettings:
    max_new_tokens: int
    config: SamplingConfig
    rule: str = "greedy"  # greedy | sample | typical
    typical: tuple[float, float] = (0.09, 0.3)  # (epsilon, delta) of typical acceptance
    method: str = "tree"


def tree_loop(
    loaded: LoadedModel,
    prompt_ids: list[int],
    proposer: Proposer,
    generator: torch.Generator,
    settings: TreeSettings,
) -> Iterator[Event]:
    """Tree speculation until EOS or the budget (module docstring, steps 1-5)."""
    out, config, eos = Emitter(loaded, settings.max_new_tokens), settings.config, loaded.eos_token_ids
    layers = proposer.feature_layers
    state, first = runtime.prefill(loaded, prompt_ids, hidden_states=bool(layers))
    step = 0
    try:
        processed = process_logits(first.logits[-1:], config, prompt_ids)  # [1, V]
        root = choose_token(processed[0], config, generator)
        yield from out.emit(step, [root], ["target"], processed)
        features = features_of(first.hidden_states, layers) if layers else None  # [n, F]
        if getattr(proposer, "reads_prompt", False):  # every prompt pair (f_p, x_{p+1}), as EAGLE's references
            proposer.accept(Verified(0, list(prompt_ids[1:]) + [root], 0, features))
        else:
            proposer.accept(Verified(0, [root], len(prompt_ids) - 1, features[-1:] if layers else None))
        step = 1
        while out.stop_reason is None:
            tokens = prompt_ids + out.generated
            budget = out.remaining - 1
            context = DraftContext(tokens, budget, config, generator, eos, 0, None, step, out.text_of)
            t0 = time.perf_counter()
            with section("draft"):
                draft = proposer.propose(context)  # 1. (budget 0: an empty draft, the views still get its details)
            t1 = time.perf_counter()
            v = verify(state, root, draft, config, tokens, layers)  # 2.
            with section("accept"):
                acc = accept(draft, v.processed, settings.rule, config, generator, settings.typical).ended_by(eos)
            commit(state, v, draft, acc)  # 4.
            rows = path_rows(acc)
            proposer.accept(Verified(len(acc.accepted), acc.tokens, v.n_past, None if v.features is None
                                     else v.features[rows]))  # fmt: skip
            before = len(out.generated)
            emitted = list(out.emit(step, acc.tokens, sources_of(len(acc.accepted), acc.source),
                                    v.processed[rows][: len(acc.tokens)]))  # fmt: skip
            yield from draft.events  # 5.
            times = (t1 - t0, v.verify_s)
            n_out = len(out.generated) - before
            yield tree_round(step, settings.method, settings.rule, root, draft, v.processed, acc, n_out, out.text_of,
                             times)  # fmt: skip
            yield from emitted
            root = acc.tokens[-1]
            step += 1
        wall = time.perf_counter() - out.start
        yield RunFinished(step, out.stop_reason, wall, len(prompt_ids), state.forwards, proposer.forwards)
    finally:
        state.cache.reset()
        proposer.close()
