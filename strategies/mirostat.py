"""Mirostat v1 and v2 (Basu et al., ICLR 2021): the strategy's Params and run; the samplers, the feedback rule
and the decode loop are in `lab.methods.mirostat` (its docstring covers the conventions and what is not covered)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.methods.mirostat import (
    COMPARE,
    CONVENTIONS,
    DEFAULT_ETA,
    VERSIONS,
    LoopSpec,
    MirostatSampler,
    TruncationSampler,
    decode_loop,
)
from lab.params import DecodeParams, param
from lab.registry import Strategy
from lab.trace import Event, RunFinished


@dataclass(frozen=True)
class MirostatParams(DecodeParams):
    version: str = param("v2", choices=VERSIONS, help="v1: top-k with k from the Zipf estimate; v2: keep S <= mu.")
    tau: float = param(3.0, low=0.25, high=12.0, help="Target surprise tau in bits (perplexity 2^tau); mu_0 = 2 tau.")
    eta: float = param(
        0.0, low=0.0, high=2.0, help="mu <- mu - eta (S - tau); 0 = the convention's default (paper 1, llama.cpp 0.1)."
    )
    m: int = param(
        100,
        low=2,
        high=1000,
        help="v1: s_hat = least-squares Zipf exponent of the m most probable tokens.",
        only_when=("version", "v1"),
    )
    temperature: float = param(1.0, low=0.05, high=2.0, help="p = softmax(z / T) before Mirostat (the paper: T = 1).")
    convention: str = param(
        "paper",
        choices=CONVENTIONS,
        help="paper: S on the untruncated p, k = round(k) + 1; llama.cpp: S on the truncated p, k = floor(k).",
    )
    ignore_eos: bool = param(False, help="Mask end-of-sequence tokens: always generate max_new_tokens tokens.")
    compare: bool = param(False, help="Also replay top-k (k=40) and top-p (p=0.9) on the same prompt and seed.")


def resolved_eta(params: MirostatParams) -> float:
    """eta, or the convention's default when eta = 0."""
    return params.eta if params.eta > 0 else DEFAULT_ETA[params.convention]


def run(
    loaded: LoadedModel, prompt_ids: list[int], params: MirostatParams, generator: torch.Generator
) -> Iterator[Event]:
    """The Mirostat run (TokenEmitted + MirostatStep per token), then the optional comparison replays."""
    start = time.perf_counter()
    replay_state = generator.get_state()
    sampler = MirostatSampler(
        params.version, params.tau, resolved_eta(params), params.m, params.temperature, params.convention
    )
    spec = LoopSpec("mirostat", params.version, params.tau, params.max_new_tokens, params.ignore_eos, True)
    stop_reason, forwards, emitted = yield from decode_loop(loaded, prompt_ids, sampler, spec, generator, start)
    if params.compare:
        for method, value in COMPARE:
            baseline = TruncationSampler(method, value)
            replay = torch.Generator(device=generator.device)
            replay.set_state(replay_state)
            spec = LoopSpec(method, baseline.label, params.tau, emitted, params.ignore_eos, False)
            _, extra, _ = yield from decode_loop(loaded, prompt_ids, baseline, spec, replay, start)
            forwards += extra
    yield RunFinished(emitted, stop_reason, time.perf_counter() - start, len(prompt_ids), forwards)


STRATEGY = Strategy(
    name="mirostat",
    family="logit-level",
    summary="Feedback-controlled truncation that holds the mean surprise at a target tau (v1, v2).",
    paper="Basu et al. 2021 (ICLR), Mirostat, Alg. 1; Mirostat 2.0 as in llama.cpp",
    Params=MirostatParams,
    run=run,
)
