"""Parameters shared by several draft-then-verify strategies (a strategy never imports another: what two share
lives here): `ChainParams` (vanilla SD, and SSD on top of it) and `HeadTreeParams` (Medusa and MTPC), with the
helpers that turn them into loop settings and proposers."""

from __future__ import annotations

from dataclasses import dataclass

from lab.engine.models import LoadedModel
from lab.engine.sampling import SamplingConfig
from lab.params import DecodeParams, param
from lab.speculative.chain import ChainSettings
from lab.speculative.draft import Proposer
from lab.speculative.proposers import DRAFTERS, make_chain_proposer
from lab.speculative.tree import TreeSettings

TREE_MODES = ("greedy", "typical", "sample")


@dataclass(frozen=True)
class ChainParams(DecodeParams):
    drafter: str = param(
        "prompt-lookup",
        choices=DRAFTERS,
        help="Who drafts: n-gram lookup in the text (q = None), the target's first L layers, or a draft model.",
    )
    gamma: int = param(6, low=1, high=16, help="Draft length gamma: tokens proposed per target forward (at most).")
    adaptive: bool = param(False, help="Adapt gamma: +1 after a fully accepted draft, -1 after a rejection.")
    gamma_max: int = param(12, low=1, high=32, help="Upper bound of adaptive gamma (the start is clipped to it).")
    draft_model: str = param(
        "",
        help="drafter=model: a Hugging Face id or path with the same tokenizer (empty = target).",
        only_when=("drafter", "model"),
    )
    draft_layers: int = param(
        8,
        low=1,
        high=256,
        help="drafter=self-draft: L, the target's first L layers draft.",
        only_when=("drafter", "self-draft"),
    )
    max_ngram: int = param(
        4,
        low=1,
        high=8,
        help="drafter=prompt-lookup: longest suffix n-gram searched for.",
        only_when=("drafter", "prompt-lookup"),
    )
    lookup_scaling: bool = param(
        True,
        help="drafter=prompt-lookup: draft at most 2n - 1 tokens after a match of n tokens (else gamma).",
        only_when=("drafter", "prompt-lookup"),
    )
    temperature: float = param(0.0, low=0.0, high=2.0, help="p = softmax(z / T) for target and draft (0 = greedy).")
    top_k: int = param(0, low=0, high=1000, help="Keep the k most likely tokens of p and q (0 = off).")
    top_p: float = param(1.0, low=0.05, high=1.0, help="Nucleus on p and q: smallest top set with mass >= top_p.")
    min_p: float = param(0.0, low=0.0, high=0.5, help="Drop tokens with p < min_p * p_max (0 = off).")
    repetition_penalty: float = param(
        1.0, low=1.0, high=2.0, help="Seen tokens: z / r if z > 0 else z * r, on target and draft (1 = off)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)


def chain_settings(params: ChainParams) -> ChainSettings:
    return ChainSettings(params.max_new_tokens, params.sampling, params.gamma, params.adaptive, params.gamma_max)


def chain_proposer(loaded: LoadedModel, params: ChainParams) -> Proposer:
    """The drafter the params name, with its settings."""
    return make_chain_proposer(
        loaded,
        params.drafter,
        draft_model=params.draft_model,
        draft_layers=params.draft_layers,
        max_ngram=params.max_ngram,
        lookup_scaling=params.lookup_scaling,
    )


@dataclass(frozen=True)
class HeadTreeParams(DecodeParams):
    mode: str = param(
        "greedy",
        choices=TREE_MODES,
        help="greedy: exact; typical: p(x) > min(eps, delta e^-H) (lossy); sample: lossless.",
    )
    tree_nodes: int = param(4, low=1, high=64, help="Candidate tree size: the first N paths of the tuned tree.")
    temperature: float = param(
        0.7, low=0.05, high=2.0, help="typical / sample: p = softmax(z / T).", only_when=("mode", ("typical", "sample"))
    )
    top_p: float = param(1.0, low=0.05, high=1.0, help="sample: nucleus on p (1 = off).", only_when=("mode", "sample"))
    epsilon: float = param(
        0.09,
        low=0.0,
        high=1.0,
        help="typical: hard threshold epsilon in min(eps, delta e^-H).",
        only_when=("mode", "typical"),
    )
    delta: float = param(
        0.3,
        low=0.0,
        high=1.0,
        help="typical: entropy-scaled threshold delta in min(eps, delta e^-H).",
        only_when=("mode", "typical"),
    )
    heads_path: str = param(
        "", help="Lab heads file/stem; Medusa also a FasterDecoding folder or Hub id (empty = shipped heads)."
    )

    @property
    def sampling(self) -> SamplingConfig:
        if self.mode == "greedy":
            return SamplingConfig(temperature=0.0)
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p if self.mode == "sample" else 1.0)


def tree_settings(params: HeadTreeParams, method: str) -> TreeSettings:
    return TreeSettings(params.max_new_tokens, params.sampling, params.mode, (params.epsilon, params.delta), method)
