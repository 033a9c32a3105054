"""Hugging Face Spaces ZeroGPU support: run the model work inside a `spaces.GPU` function when the Space has one.

On a ZeroGPU Space a GPU is attached only while a function decorated with `spaces.GPU` runs, and that function
must return (or yield) plain, picklable data. The app therefore splits every run in two: `model_events`
(load the model, encode the prompt, stream the strategy's trace events: plain frozen dataclasses) is wrapped
with `gpu_function`, and the figures are built outside it from those events.
`zero_gpu_enabled()` is true only when the environment says this is a ZeroGPU Space (SPACES_ZERO_GPU set, as
Spaces does) and the `spaces` package imports; everywhere else (a laptop, a CPU Space, a dedicated GPU)
`gpu_function` returns the function unchanged, and a missing `spaces` package never breaks the app.
Not covered: ZeroGPU quotas (the Space's settings), running the model outside the decorated function.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

TRUE = {"1", "true", "yes", "on"}


def zero_gpu_requested() -> bool:
    """The environment asks for ZeroGPU (Spaces sets SPACES_ZERO_GPU on ZeroGPU hardware)."""
    return os.environ.get("SPACES_ZERO_GPU", "").strip().lower() in TRUE


def _spaces_module() -> Any | None:
    try:
        return importlib.import_module("spaces")
    except Exception:  # absent, or failing to initialise outside a Space: run without it
        return None


def zero_gpu_enabled() -> bool:
    return zero_gpu_requested() and _spaces_module() is not None


def gpu_function(fn: Callable, duration: int) -> Callable:
    """`spaces.GPU(duration=...)(fn)` on ZeroGPU, else `fn` itself (generator functions are supported by both)."""
    if not zero_gpu_requested():
        return fn
    spaces = _spaces_module()
    if spaces is None:
        print("[decoding-lab] SPACES_ZERO_GPU is set but the `spaces` package is missing; running without it.")
        return fn
    return spaces.GPU(duration=duration)(fn)
