"""Reference rows of the benchmark (`lab.tools.bench`): Hugging Face generate and assisted generation, llama.cpp.

Covered: `time_hf_generate` (greedy `model.generate` on the lab's prompt ids and model, optionally assisted:
prompt lookup or an assistant model, `hf_assist_kwargs`), and the llama.cpp row: `LlamaCppRow` runs
llama-cpp-python's plain greedy decoding (temperature 0: llama.cpp's greedy sampler) of the same GGUF file on
the same prompt ids with the same thread count, its KV cache reset before every run so no prompt prefix is
reused between runs (llama-cpp-python otherwise keeps a matching prefix). Every row stops at the model's EOS
ids and times prefill plus decoding, like the strategies. llama-cpp-python is an optional extra built from
source (`make bench-deps`); without it `LlamaCppRow` raises InputError saying how to get it.
Not covered: sampling in the reference rows, llama.cpp for models that are not a local GGUF file.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from dataclasses import dataclass
from typing import Any

import torch

from lab.engine.models import EMBEDDED_GGUF, EMBEDDED_MODEL, LoadedModel, embedded_model_dir
from lab.params import InputError
from lab.speculative.proposers.draft_model import load_draft_model
from lab.speculative.proposers.self_draft import self_draft_view

HF_ROW = "hf-generate"
HF_ASSIST_ROW = "hf-assist"
LLAMA_CPP_ROW = "llama.cpp"
HF_PROMPT_LOOKUP = "prompt-lookup"
HF_SELF_DRAFT = "self-draft"
LLAMA_CPP_HINT = (
    "llama-cpp-python is not installed; `make bench-deps` builds it from source for this CPU "
    '(or: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python)'
)


@dataclass(frozen=True)
class RunSample:
    """One timed run: its tokens/s and the numeric statistics of the run."""

    tokens_per_s: float
    new_tokens: int
    metrics: dict[str, float]
    stop_reason: str
    token_ids: tuple[int, ...] = ()
    forward_path: str = ""  # the path the run's forwards took (lab.engine.forward_path; "" for the reference rows)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_hf_generate(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int, **assist: Any) -> RunSample:
    """Greedy `model.generate` on the same ids; stops at the same EOS ids as the strategies. `assist` goes to
    generate (prompt_lookup_num_tokens, max_matching_ngram_size or assistant_model); target calls are counted."""
    eos = list(loaded.eos_token_ids)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.device)  # [1, T]
    attention_mask = torch.ones_like(input_ids)
    calls: list[int] = []
    hook = loaded.model.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.inference_mode():
        _synchronize(loaded.device)
        start = time.perf_counter()
        output = loaded.model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **assist,
        )  # [1, T + n]
        _synchronize(loaded.device)
        wall = time.perf_counter() - start
    hook.remove()
    new_tokens = int(output.shape[1] - input_ids.shape[1])
    stop = "eos" if new_tokens and int(output[0, -1]) in eos else "max_new_tokens"
    rate = new_tokens / wall if wall > 0 else 0.0
    per_token = len(calls) / new_tokens if new_tokens else 0.0
    metrics = {"new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": rate, "forwards_per_token": per_token}
    return RunSample(rate, new_tokens, metrics, stop, tuple(int(t) for t in output[0, input_ids.shape[1] :]))


def hf_assist_kwargs(loaded: LoadedModel, hf_assist: str, settings: dict[str, int]) -> tuple[dict, str]:
    """generate() keyword arguments and the row note for `--hf-assist` (prompt-lookup or a model spec)."""
    if hf_assist == HF_PROMPT_LOOKUP:
        tokens, ngram = settings.get("gamma", 10), settings.get("max_ngram", 2)
        kwargs = {"prompt_lookup_num_tokens": tokens, "max_matching_ngram_size": ngram}
        return kwargs, f"transformers assisted generation, prompt lookup ({tokens} tokens, n-gram {ngram})"
    if hf_assist.startswith(HF_SELF_DRAFT):  # self-draft or self-draft:L, the lab's self-drafter as the assistant
        layers = hf_assist.removeprefix(HF_SELF_DRAFT).lstrip(":") or str(settings.get("draft_layers", 8))
        if not layers.isdigit():
            raise InputError(f"--hf-assist self-draft:L needs an integer L, got {hf_assist!r}.")
        draft = self_draft_view(loaded, int(layers))
    else:
        draft = loaded if hf_assist == loaded.spec else load_draft_model(loaded, hf_assist)
    config = copy.deepcopy(draft.model.generation_config)
    config.num_assistant_tokens = settings.get("gamma", 20)
    config.num_assistant_tokens_schedule = "constant"
    draft.model.generation_config = config
    note = f"transformers assisted generation, assistant {hf_assist} ({config.num_assistant_tokens} tokens)"
    return {"assistant_model": draft.model}, note


def gguf_path(loaded: LoadedModel) -> str:
    """The GGUF file behind `loaded` (the embedded model, or a spec that names a .gguf file)."""
    if loaded.spec == EMBEDDED_MODEL and embedded_model_dir() is not None:
        return str(embedded_model_dir() / EMBEDDED_GGUF)
    if loaded.spec.endswith(".gguf"):
        return loaded.spec
    raise InputError(f"--llama-cpp needs a GGUF model; {loaded.spec!r} is not one (use {EMBEDDED_MODEL}).")


class LlamaCppRow:
    """llama-cpp-python's greedy decoding of the model's GGUF, loaded once, `threads` CPU threads."""

    def __init__(self, loaded: LoadedModel, max_tokens: int) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise InputError(LLAMA_CPP_HINT)
        import llama_cpp

        self.path = gguf_path(loaded)
        self.threads = torch.get_num_threads()
        self.eos = set(loaded.eos_token_ids)
        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(
            model_path=self.path,
            n_ctx=max(512, max_tokens),
            n_threads=self.threads,
            n_threads_batch=self.threads,
            verbose=False,
        )

    @property
    def note(self) -> str:
        return f"llama-cpp-python {self.version}, greedy, same GGUF and prompt ids, {self.threads} threads"

    def time(self, prompt_ids: list[int], max_new_tokens: int) -> RunSample:
        """One greedy run from an empty cache: prefill plus up to `max_new_tokens` tokens (EOS counted)."""
        self.llm.reset()  # forget the previous run's KV, so no prompt prefix is reused
        tokens: list[int] = []
        stop = "max_new_tokens"
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in self.eos:
                stop = "eos"
                break
            if len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        rate = len(tokens) / wall if wall > 0 else 0.0
        metrics = {"new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": rate, "forwards_per_token": 1.0}
        return RunSample(rate, len(tokens), metrics, stop, tuple(tokens))
