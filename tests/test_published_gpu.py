"""Published head layouts on CUDA (`make gpu-check`; skipped without a GPU): tiny random models built on the device.

Each layout of tests/published_ckpt.py loads through `heads_path` onto the device of a tiny random Llama and
Qwen2 (fp32 and bf16): the head's tensors live there in the model's dtype, greedy EAGLE / Medusa equal plain
greedy token for token, and a seeded sampled run repeats itself with a device generator.
`DECODING_LAB_TEST_DEVICE=cpu pytest -m gpu tests/test_published_gpu.py` runs the same checks on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from lab.app.runner import make_generator
from lab.engine.models import wrap_model
from lab.heads import published_build
from lab.params import build_params
from lab.trace import TokenEmitted
from strategies import collect, get_strategy
from tests import published_ckpt as ckpt
from tests.test_published import tiny_qwen2
from tests.tiny import ByteTokenizer, tiny_llama

DEVICE = os.environ.get("DECODING_LAB_TEST_DEVICE", "cuda")
D = ckpt.DIMS
LAYOUTS = ("eagle", "eagle3", "speculators-eagle3", "medusa")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(
    scope="module",
    params=[("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)],
    ids=["llama-fp32", "qwen2-fp32", "llama-bf16"],
)
def target(request):
    family, dtype = request.param
    model = tiny_llama(seed=5, layers=D["layers"], hidden=D["hidden"]) if family == "llama" else tiny_qwen2(6)
    return wrap_model(model.to(DEVICE, dtype), ByteTokenizer(), spec=f"tiny-{family}-{dtype}")


def run(loaded, name: str, prompt: list[int], seed: int = 0, **values) -> list[int]:
    s = get_strategy(name)
    events = collect(s.run(loaded, prompt, build_params(s.Params, values), make_generator(seed, loaded.device)))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layouts_on_the_device(target, layout, tmp_path) -> None:
    qwen = type(target.model).__name__.startswith("Qwen2")
    extra = {"qkv_bias": qwen} if layout == "eagle" else {}
    folder = ckpt.write(layout, tmp_path / layout, embed=target.embeddings.weight.detach().float().cpu(), **extra)
    name = "medusa" if layout == "medusa" else "eagle"
    head = published_build.cached(name, target, str(folder))
    tensors = [head.weight, head.lm_weight] if layout == "medusa" else list(head.parameters())
    assert {(t.device.type, t.dtype) for t in tensors} == {(target.device.type, target.dtype)}
    prompt = target.encode("published heads on a GPU", chat=False)
    plain = run(target, "greedy", prompt, max_new_tokens=24)
    assert run(target, name, prompt, max_new_tokens=24, heads_path=str(folder)) == plain
    values = {"max_new_tokens": 16, "heads_path": str(folder), "mode": "sample", "temperature": 1.0}
    sampled = run(target, name, prompt, seed=4, **values)
    assert sampled and run(target, name, prompt, seed=4, **values) == sampled
