"""SSD, speculative speculative decoding (Kumar, Dao, May 2026, ICLR): vanilla speculative decoding whose drafter
works while the target verifies, pre-drafting the next round for the likely verification outcomes.

Each round: 1. the draft is taken from the speculation cache when the last round's outcome (k accepted, token
t) was guessed (a hit; a branch cut short is drafted on to gamma on the main thread), else drafted on the main
thread (a miss), 2. the drafter thread (`lab.speculative.schedules.ssd.Speculator`) starts guessing this round's
outcomes, best first
(`plan_outcomes`: acceptance rate alpha and the drafter's top-F candidates per position), and
pre-drafts the next round for each, 3. the target verifies the draft in one forward and `accept_chain` decides
(Leviathan et al. 2023, Alg. 1; the chain loop `lab.speculative.chain.chain_loop`, exactly as vanilla SD), 4. the
drafter thread is stopped (it finishes the forward in flight) and the actual outcome is looked up, 5. the
round's `DraftRound`, `SpeculationRound`, `PipelineSpan`s (who ran what when: the Gantt view) and tokens
stream out, 6. gamma adapts as in vanilla SD (for the guessed branches it is computed per guessed outcome).

Losslessness: every round's draft is drawn from q on that round's exact context, independently of its own
acceptance draws (see `lab.speculative.schedules.ssd`), so greedy output equals greedy decoding and sampled output
is distributed as
the target's; sampled runs are not reproducible from the seed because hits depend on timing.
Threads (CPU): the drafter thread runs `draft_threads` torch threads, the target's thread `target_threads` during
its verify (0 = auto: the rest of the cores); `lab.speculative.schedules.ssd` documents the split and restores it.
Not covered: CUDA streams or a second device for the drafter, batched branch drafting (the paper's GPU
path), Saguaro sampling, tree drafts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.params import param
from lab.registry import Strategy
from lab.speculative.chain import chain_loop, next_gamma
from lab.speculative.draft import Proposer
from lab.speculative.params import ChainParams, chain_proposer, chain_settings
from lab.speculative.proposers import DRAFTERS
from lab.speculative.schedules.ssd import SSDSchedule, SSDSettings
from lab.trace import Event


@dataclass(frozen=True)
class SSDParams(ChainParams):
    drafter: str = param(
        "self-draft",
        choices=DRAFTERS,
        help="Who drafts (and speculates in its thread): the target's first L layers, a draft model, or n-gram lookup.",
    )
    gamma: int = param(4, low=1, high=16, help="Draft length gamma: tokens proposed per target forward (at most).")
    fanout: int = param(
        3, low=1, high=8, help="F: candidate tokens t per position guessed for the outcome (k accepted, then t)."
    )
    draft_threads: int = param(1, low=0, high=64, help="torch threads of the drafter thread (0 = inherit).")
    target_threads: int = param(
        0, low=0, high=64, help="torch threads of the target's thread (0 = auto: the rest of the cores, see docs)."
    )


def ssd_loop(
    loaded: LoadedModel, prompt_ids: list[int], params: SSDParams, proposer: Proposer, generator: torch.Generator
) -> Iterator[Event]:
    """The chain loop over `proposer`, scheduled by SSD's speculator (its thread starts with the first event)."""
    settings = chain_settings(params)
    ssd = SSDSettings(
        params.fanout,
        params.draft_threads,
        params.target_threads,
        params.max_new_tokens,
        lambda gamma, drafted, accepted: next_gamma(gamma, drafted, accepted, settings),
    )
    model_drafter = params.drafter != "prompt-lookup"
    schedule = SSDSchedule(
        proposer, settings.config, loaded.eos_token_ids, ssd, generator, model_drafter, len(prompt_ids)
    )
    yield from chain_loop(loaded, prompt_ids, proposer, generator, settings, schedule)


def run(loaded: LoadedModel, prompt_ids: list[int], params: SSDParams, generator: torch.Generator) -> Iterator[Event]:
    return ssd_loop(loaded, prompt_ids, params, chain_proposer(loaded, params), generator)


STRATEGY = Strategy(
    name="ssd",
    family="speculative",
    summary="Speculative decoding whose drafter pre-drafts the next round for likely outcomes during verification.",
    paper="Kumar, Dao, May 2026, Speculative Speculative Decoding (ICLR 2026); Leviathan et al. 2023 (Alg. 1)",
    Params=SSDParams,
    run=run,
)
