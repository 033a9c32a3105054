"""The strategy contract (DESIGN.md section 6): a named object with typed Params and a streaming `run`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lab.models import LoadedModel
from lab.trace import Event

FAMILIES = ("baseline", "logit-level", "system 2", "speculative", "multi-token heads")

RunFn = Callable[[LoadedModel, list[int], object, torch.Generator], Iterator[Event]]


@dataclass(frozen=True)
class Strategy:
    """A decoding method: `run(model, prompt_ids, params, generator)` yields trace events as it decodes."""

    name: str
    family: str
    summary: str
    paper: str
    Params: type
    run: RunFn

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r} for strategy {self.name!r}")


def collect(events: Iterator[Event]) -> list[Event]:
    """The non-streaming result of a run: every event it yields."""
    return list(events)
