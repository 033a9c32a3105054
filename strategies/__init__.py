"""The strategies: one module per method, each defining `STRATEGY` (Params, run). Importing this package
registers every such module in `lab.registry` (found with pkgutil, so adding a strategy is adding a module);
the names below are re-exported for the app and the tests."""

from __future__ import annotations

import importlib
import pkgutil

from lab.registry import ORDER, Strategy, by_family, collect, get_strategy, register


def _discover() -> list[Strategy]:
    """Import every strategy module of this package and return its STRATEGY."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        strategy = getattr(importlib.import_module(f"{__name__}.{info.name}"), "STRATEGY", None)
        if isinstance(strategy, Strategy):
            found.append(strategy)
    return found


REGISTRY: dict[str, Strategy] = register(_discover())

__all__ = ["ORDER", "REGISTRY", "Strategy", "by_family", "collect", "get_strategy"]
