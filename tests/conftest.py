"""Shared fixtures: the embedded model (loaded once per test session, fp32 reference) and tiny random Llamas."""

from __future__ import annotations

import pytest

from lab.engine.models import LoadedModel, load_model
from tests.tiny import tiny_loaded_model


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """SmolLM2-135M-Instruct from the embedded GGUF, fp32 on CPU (the exactness reference)."""
    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """A seeded 2-layer random Llama (hidden 64, vocab 256) with a byte tokenizer."""
    return tiny_loaded_model(seed=0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run thousands of small forwards: one thread avoids OpenMP spin contention on shared CPUs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def repeating_prompt_ids(tiny) -> list[int]:
    """A prompt that repeats itself, so prompt lookup finds matches."""
    return tiny.encode("The lab decodes the lab decodes the", chat=False)
