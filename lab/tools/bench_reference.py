"""Reference rows of the benchmark (`lab.tools.bench`): Hugging Face generate and assisted generation, llama.cpp.

Covered: `time_hf_generate` (greedy `model.generate` on the lab's prompt ids and model, optionally assisted:
prompt lookup or an assistant model, `hf_assist_kwargs`), and the llama.cpp row: `LlamaCppRow` runs
llama-cpp-python's plain greedy decoding (temperature 0: llama.cpp's greedy sampler) of the same GGUF file on
the same prompt ids with the same thread count, its KV cache reset before every run so no prompt prefix is
reused between runs (llama-cpp-python otherwise keeps a matching prefix). Every row stops at the model's EOS
ids and times prefill plus decoding, like the strategies, and splits the two (`RunSample.prefill_s`,
`decode_tokens_per_s`): hf-generate by a streamer that notes when the first new token arrives, llama.cpp by its
own performance counters (`llama_perf_context`, or `llama_get_timings` in older bindings: prompt-eval ms, and
eval ms over eval count). llama-cpp-python is an optional extra built from source (`make bench-deps`); without
it `LlamaCppRow` raises InputError saying how to get it (its tests use a stand-in module).
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
    """One timed run: its end-to-end tokens/s (prefill included) and the numeric statistics of the run; with
    the split, `prefill_s` (prompt to first new token) and `decode_tokens_per_s` (the tokens after the first over
    the time after it; 0.0 when the run has fewer than two tokens)."""

    tokens_per_s: float
    new_tokens: int
    metrics: dict[str, float]
    stop_reason: str
    token_ids: tuple[int, ...] = ()
    prefill_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    forward_path: str = ""  # the path the run's forwards took (lab.engine.forward_path; "" for the reference rows)


def decode_rate(new_tokens: int, wall_s: float, prefill_s: float) -> float:
    """Tokens after the first over the seconds after the first token (0.0 when undefined)."""
    decode_s = wall_s - prefill_s
    return (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else 0.0


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives (its first put is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


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
    clock = _FirstTokenClock()
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
            streamer=clock,
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
    prefill = (clock.first - start) if clock.first is not None else wall
    ids = tuple(int(t) for t in output[0, input_ids.shape[1] :])
    return RunSample(rate, new_tokens, metrics, stop, ids, prefill, decode_rate(new_tokens, wall, prefill))


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

    def _perf_api(self) -> tuple[Any, Any, Any] | None:
        """(context, read, reset) of llama.cpp's own performance counters: `llama_perf_context` or, in older
        bindings, `llama_get_timings`; None when the binding has neither."""
        import llama_cpp

        ctx = getattr(self.llm, "ctx", None) or getattr(getattr(self.llm, "_ctx", None), "ctx", None)
        read = getattr(llama_cpp, "llama_perf_context", None) or getattr(llama_cpp, "llama_get_timings", None)
        reset = getattr(llama_cpp, "llama_perf_context_reset", None) or getattr(llama_cpp, "llama_reset_timings", None)
        return None if ctx is None or read is None or reset is None else (ctx, read, reset)

    def _counters(self) -> tuple[float, float, int] | None:
        """(prompt-eval ms, eval ms, eval count) since the last reset, or None without counters."""
        api = self._perf_api()
        if api is None:
            return None
        data = api[1](api[0])
        data = getattr(data, "contents", data)  # some bindings return a pointer to the struct
        return float(data.t_p_eval_ms), float(data.t_eval_ms), int(data.n_eval)

    def time(self, prompt_ids: list[int], max_new_tokens: int) -> RunSample:
        """One greedy run from an empty cache: prefill plus up to `max_new_tokens` tokens (EOS counted). Prefill
        and decode rate come from llama.cpp's counters (its compute time alone, sampling excluded)."""
        self.llm.reset()  # forget the previous run's KV, so no prompt prefix is reused
        if (api := self._perf_api()) is not None:
            api[2](api[0])  # zero the counters: they then cover this run alone
        tokens: list[int] = []
        stop = "max_new_tokens"
        start = time.perf_counter()
        first = None
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            first = first or time.perf_counter()
            if token in self.eos:
                stop = "eos"
                break
            if len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - start
        rate = len(tokens) / wall if wall > 0 else 0.0
        metrics = {"new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": rate, "forwards_per_token": 1.0}
        counters = self._counters()
        if counters is None:  # no counters in this binding: split the wall time at the first token
            prefill = (first or time.perf_counter()) - start
            split = (prefill, decode_rate(len(tokens), wall, prefill))
            return RunSample(rate, len(tokens), metrics, stop, tuple(tokens), *split)
        prefill_ms, eval_ms, evals = counters
        decode = evals / (eval_ms / 1000) if evals and eval_ms > 0 else 0.0
        metrics |= {"llama_prompt_eval_ms": prefill_ms, "llama_eval_ms": eval_ms, "llama_evals": evals}
        return RunSample(rate, len(tokens), metrics, stop, tuple(tokens), prefill_ms / 1000, decode)
