"""Strategy registry: one module per method, looked up by the names the CLI, app, bench and traces share.

Planned names, in the order their issues land: greedy, sample, dola, cfg, mirostat, speculative, ssd, medusa,
mtpc, eagle, tot, rlm. Only implemented strategies are registered.
"""

from __future__ import annotations

from lab.params import InputError
from strategies import cfg, dola, greedy, mirostat, sample, speculative
from strategies.base import FAMILIES, Strategy, collect

REGISTRY: dict[str, Strategy] = {
    module.STRATEGY.name: module.STRATEGY for module in (greedy, sample, dola, cfg, mirostat, speculative)
}


def get_strategy(name: str) -> Strategy:
    """The registered strategy called `name`, or an InputError listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise InputError(f"Unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}.") from None


def by_family() -> dict[str, list[Strategy]]:
    """Registered strategies grouped by family, in the fixed family order."""
    return {family: [s for s in REGISTRY.values() if s.family == family] for family in FAMILIES}


__all__ = ["REGISTRY", "Strategy", "by_family", "collect", "get_strategy"]
