"""The decoder layers of a row-invariant Llama forward as one C++ call (issue 17: per-step overhead).

After `lab.engine.lean_forward`, a decode step of the embedded model still runs about a hundred small tensor ops per
layer from Python, and the interpreter between them costs more than the matrix products. For the forwards that
decide what lossless decoding emits on a CPU (one-token steps, and verify forwards under
`lab.engine.invariance.rows_invariant`, of a batch of one, in bf16 / fp16 with `lab.engine.invariance`'s
row-invariant attention), `lab/engine/native/decoder_layers.cpp` runs the 30 layers and the final norm as one call
of a PyTorch custom op. Its steps compute the bits the Python forward computes (transformers' `LlamaRMSNorm`,
`LlamaAttention` and `LlamaMLP` as `lab.engine.lean_forward` runs them, `lab.engine.quant`'s linears): the float
products and the SiLU are the same ATen calls with the same arguments, the bf16 low-bit products the op's own
kernels with ATen's bits (lab/engine/native/lowbit_mm.h, which `lab.engine.quant`'s linears call too); the norms,
the rotary embedding, the residual adds and gate * up are the op's own loops doing ATen's float operations in ATen's
order (the norm's sum emulates ATen's cascade sum in the vector width `lanes()` finds on this CPU by comparing with
`torch.sum`; where none matches, and for fp16, those steps stay ATen calls). The attention is
`lab.engine.invariance.exact_attention`'s float64 attention computed by one loop per (head, query row): the same
exact float64 scores, ATen's softmax, and a weighted sum of values in another order than the batched product, so its
bf16 outputs equal `exact_attention`'s except where a ~1e-16 relative difference lands on a rounding boundary (the
odds `exact_attention`'s docstring gives; none seen in the tests). Each row's loop is the same whatever the row
count, so a verify row equals the decode step of its path bit for bit. Logits, hidden states and cache are tested
equal to the Python loop's and to `model(...)`'s on tiny models at every precision and on the embedded model. The
embedding, the causal mask, the rotary table, the hidden-key mask and the LM head stay in Python, once per forward.
The op extends each layer's cache in place: a cache it made is a view of the first positions of a longer buffer,
and a forward writes its keys and values after them (a new buffer, with room for more, only when it is full), so a
step no longer copies the whole cache of every layer; this relies on `lab.engine.runtime`'s rule that a cache's
tensors belong to that cache alone.

The op is compiled from `lab/engine/native/decoder_layers.cpp` and the low-bit kernels (`SOURCES`) with
`torch.utils.cpp_extension` (a C++ compiler and ninja; about a minute on two cores, cached in `build_directory()`:
inside the environment lab runs in, so each install builds its own): `python -m lab.engine.native_forward` builds it
ahead of time (the Makefile's install and
the bench do); otherwise the first run that could use it starts the build in the background, and runs that start
before it is ready keep the Python loop for their whole length (`lab.engine.forward_path` decides once per run).
Without a compiler, or when the build fails, they keep it for good, after one warning.
`decode_steps` runs B one-token decode steps of B sequences, each with its own cache and position, as one call of
the same op (`lab.engine.runtime.decode_steps`, which `lab distill` uses): the products take all B rows at once
and each sequence's attention runs over its own cache, so row b is that sequence's own decode step bit for bit.
`draft_layer` runs the one decoder layer of an EAGLE draft head served at a low-bit precision (EAGLE-1's layer,
EAGLE-3's `midlayer`, whose q / k / v read [norm(e); norm(g)]) as one call of the op's `draft_layer`, with the same
steps as a target layer and the head's cache extended in place: the drafts move only by its exact attention's
rounding against SDPA. `DECODING_LAB_NATIVE_FORWARD=0` turns the op off. Prefill, padded batches, float32 and CUDA
models, and models with other modules (adapters, other linears) keep `lab.engine.lean_forward`'s Python loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import operator
import os
import sys
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache
from transformers.activations import SiLUActivation
from transformers.cache_utils import DynamicLayer

from lab.engine import invariance
from lab.engine.quant import LOWBIT_SWITCH, Int4Linear, Int8Linear, W4A8Linear, joined_linears

SWITCH = "DECODING_LAB_NATIVE_FORWARD"  # "0" keeps every forward on lab.engine.lean_forward's Python loop
SOURCE = Path(__file__).with_name("native") / "decoder_layers.cpp"
SOURCES = (
    SOURCE,
    SOURCE.with_name("attention_avx512.cpp"),
    *(SOURCE.with_name(f"lowbit_{kind}.cpp") for kind in ("int4", "int8", "w4a8", "w8a8")),
    SOURCE.with_name("row_top.cpp"),
)  # + the attention's AVX-512 loop, the low-bit products, the top tokens of logit rows
EXTENSION = "decoding_lab_native"
LINEAR_KINDS = {"two-row float": 0, "int8": 1, "int4": 2, "w4a8": 3}  # decoder_layers.cpp's kTwoRowFloat ... kW4A8
# the attention loop's vector instructions, from the capability PyTorch itself detected on this CPU
_VECTOR_CAPABILITIES = ("AVX2", "AVX512")
_VECTOR_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_LANE_CANDIDATES = (8, 16, 4)  # Vectorized<float>::size() of ATen's AVX2, AVX-512 and 128-bit kernels
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_building = False


@cache
def lanes() -> int:
    """The vector width in which ATen's float sum adds on this CPU, found by comparing the op's emulation of that
    sum (`row_sums`) with `torch.sum` on random rows of several lengths and scales (a build's sum kernel need
    not be the width the CPU reports: an AVX-512 machine can run the AVX2 kernels). 0 when no width matches:
    the op then runs the norms and elementwise steps as ATen ops instead of its own loops."""
    if not build():
        return 0
    generator = torch.Generator().manual_seed(0)
    rows = []
    for features in (7, 100, 576, 1536, 4096, 18432):
        for scale in (0.01, 1.0, 300.0):
            rows.append((torch.randn(8, features, generator=generator) * scale).pow(2))
    for width in _LANE_CANDIDATES:
        if all(torch.equal(torch.ops.decoding_lab.row_sums(x, width), x.sum(-1)) for x in rows):
            return width
    _log.warning("no vector width reproduces ATen's float sum on this CPU; the op uses ATen's ops for the norms")
    return 0


def enabled() -> bool:
    """Whether CPU forwards will use the op: the switch is on and the op builds (waits for the build)."""
    return os.environ.get(SWITCH, "1") != "0" and build()


def available() -> bool:
    """Whether the op can run now; the first call starts building it in the background (forwards keep the
    Python loop until it is ready, so no request waits for the compiler)."""
    global _building
    if _loaded is None and not _building:
        _building = True
        threading.Thread(target=build, name="native-decoder-build", daemon=True).start()
    return bool(_loaded)


def build_state() -> str:
    """One of built, failed, building (in the background), not tried; never waits (lab.engine.forward_path)."""
    if _loaded is not None:
        return "built" if _loaded else "failed"
    return "building" if _building else "not tried"


def cached_build_exists() -> bool:
    """Whether a compiled op lies in the build directory (loading it takes a second; torch recompiles only when the
    sources or flags changed)."""
    try:
        return (build_directory() / f"{EXTENSION}.so").is_file()
    except OSError:
        return False


def build_directory() -> Path:
    """Where the op is compiled and cached: `$TORCH_EXTENSIONS_DIR/decoding_lab_native` when that is set, else in
    this interpreter's prefix (the project's .venv), else torch's per-user default. Not the per-user default first:
    a build killed there (a session's end, Ctrl-C) leaves torch's `lock` file behind and every later build by any
    checkout would wait on it for ever."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    candidates = [Path(chosen)] if chosen else [Path(sys.prefix) / "torch_extensions"]
    candidates.append(Path.home() / ".cache" / "torch_extensions")
    for root in candidates:
        directory = root / EXTENSION
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
    raise OSError(f"no writable build directory for the op among {[str(c) for c in candidates]}")


@contextlib.contextmanager
def exclusive(directory: Path):
    """Hold the build directory alone, across processes, and clear a stale torch `lock` file in it.

    torch's own lock is a file that exists while a build runs and is removed when it ends; a process killed mid-build
    leaves it, and `load` then waits for ever. This takes an `flock` on a file beside it first (the kernel releases
    an flock when its process dies), so while it is held no other lab process is in `load` here and a `lock` file
    found is a dead build's."""
    with open(directory / "lab-build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if (directory / "lock").exists():
                _log.warning("removing the lock file a killed build left in %s", directory)
                (directory / "lock").unlink(missing_ok=True)
            yield directory
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def compile_flags() -> list[str]:
    """The C++ flags of the op's build. -fopenmp: at::parallel_for is an inline OpenMP region, serial without it;
    the library it links, libgomp.so.1, is the one PyTorch already loaded (torch.set_num_threads applies to the op
    too). -ffp-contract=off: no fused multiply-adds where the numerics say one rounding per operation."""
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() in _VECTOR_CAPABILITIES:
        flags += _VECTOR_FLAGS
    return flags


def build(verbose: bool = False) -> bool:
    """Compile (or load the cached build of) the op; True when `torch.ops.decoding_lab.decoder_layers` exists."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                from torch.utils.cpp_extension import load

                sources = [str(s) for s in SOURCES]
                with exclusive(build_directory()) as directory:
                    load(
                        EXTENSION,
                        sources,
                        extra_cflags=compile_flags(),
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(directory),
                        is_python_module=False,
                        verbose=verbose,
                    )
                _loaded = hasattr(torch.ops.decoding_lab, "decoder_layers")
                if _loaded and os.environ.get(LOWBIT_SWITCH, "1") == "0":
                    torch.ops.decoding_lab.lowbit_active(False)  # ATen's low-bit kernels in the layers too
            except Exception as error:  # no compiler, no ninja, a failed build: the Python loop still runs
                _log.warning("native decoder layers unavailable (%s); using the Python forward", error)
                _loaded = False
        return _loaded


def _linear(module: nn.Module, params: list, spec: list) -> bool:
    """Append one linear's parameters and [kind, has bias, in, out]; False for a module the op does not run."""
    if isinstance(module, Int8Linear) and type(module) is Int8Linear:
        kind, tensors = "int8", [module._buffers["qweight"], module._buffers["scales"]]
    elif isinstance(module, Int4Linear) and type(module) is Int4Linear:
        kind, tensors = "int4", [module._buffers["packed"], module._buffers["scales_and_zeros"]]
    elif isinstance(module, W4A8Linear) and type(module) is W4A8Linear:
        kind, tensors = "w4a8", [module._buffers["packed"], module._buffers["scales"]]
    elif type(module) is nn.Linear and getattr(module.__dict__.get("forward"), "__func__", None) is (
        invariance._two_row_forward
    ):
        kind, tensors = "two-row float", [module.weight]
    else:
        return False
    bias = module.bias
    params.extend(tensors if bias is None else [*tensors, bias])
    spec.extend([LINEAR_KINDS[kind], bias is not None, module.in_features, module.out_features])
    return True


def _group(owner: nn.Module, names: tuple[str, ...], params: list, spec: list) -> bool:
    group = joined_linears(owner, names)
    parts = group.parts if group.joined is None else (group.joined,)
    spec.append(len(parts))
    return all(_linear(part, params, spec) for part in parts)


@dataclass
class _Plan:
    """The flat parameter list and integer spec `decoder_layers` reads, the modules they were read from, and the
    count of assignments (`_assignments`) at which the plan was last found current."""

    sources: tuple
    params: list
    spec: list
    eps: float
    checked: int = -1


_assignments = 0  # submodules, parameters and buffers assigned to any nn.Module of this process so far


def _assigned(module, name, value) -> None:
    """nn.Module's global registration hook (every `module.name = value` of a submodule, parameter or buffer):
    counts the assignment, so a plan checked since the last one needs no new check (a module replaced in place
    is an assignment; a forward of a model whose modules nobody touched skips `_sources`' walk of every layer)."""
    global _assignments
    _assignments += 1


for _register in (
    nn.modules.module.register_module_module_registration_hook,
    nn.modules.module.register_module_parameter_registration_hook,
    nn.modules.module.register_module_buffer_registration_hook,
):
    _register(_assigned)


def _sources(model) -> tuple:
    """The objects whose identity the plan depends on (a replaced module or norm weight means a new plan).

    Read from the modules' own `_modules` / `_parameters` dicts, which hold what attribute access returns for
    submodules and parameters: `nn.Module.__getattr__` costs about a microsecond a name, and this runs every forward."""
    out = []
    for layer in model.model.layers:
        parts = layer._modules
        attn, mlp = parts["self_attn"]._modules, parts["mlp"]._modules
        out += [parts["input_layernorm"]._parameters["weight"], parts["post_attention_layernorm"]._parameters["weight"]]
        out += [attn["o_proj"], mlp["down_proj"], attn["q_proj"], attn["k_proj"], attn["v_proj"]]
        out += [mlp["gate_proj"], mlp["up_proj"], mlp["act_fn"]]
    out.append(model.model.norm.weight)
    return tuple(out)


def _layer_linears(layer: nn.Module, params: list, spec: list) -> bool:
    """Append a decoder layer's q / k / v group, o_proj, gate / up group (then the gate's size) and down_proj as
    decoder_layers.cpp's `project` and `finish_layer` read them; False where a module is not one the op runs."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(mlp.act_fn) not in (SiLUActivation, nn.SiLU):
        return False
    if not _group(attn, ("q_proj", "k_proj", "v_proj"), params, spec) or not _linear(attn.o_proj, params, spec):
        return False
    if not _group(mlp, ("gate_proj", "up_proj"), params, spec):
        return False
    spec.append(mlp.gate_proj.out_features)
    return _linear(mlp.down_proj, params, spec)


def _build_plan(model, sources: tuple) -> _Plan | None:
    decoder = model.model
    eps = decoder.norm.variance_epsilon
    params: list = []
    spec: list = []
    for layer in decoder.layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(norm.variance_epsilon != eps for norm in norms):
            return None
        params += [norm.weight for norm in norms]
        if not _layer_linears(layer, params, spec):
            return None
    params.append(decoder.norm.weight)
    return _Plan(sources, params, [int(v) for v in spec], float(eps))


def _current(owner: nn.Module, sources_of, build) -> _Plan | None:
    """The plan cached on `owner`, checked against `sources_of(owner)` (rebuilt by `build(owner, sources)` when a
    source changed) unless nothing was assigned to any module since its last check; None when it is empty (the op
    does not run these modules)."""
    plan = owner.__dict__.get("_lab_native_plan")
    if plan is None or plan.checked != _assignments:
        checked, sources = _assignments, sources_of(owner)
        if plan is None or len(plan.sources) != len(sources) or any(map(operator.is_not, plan.sources, sources)):
            plan = build(owner, sources) or _Plan(sources, [], [], 0.0)  # an empty plan: unsupported
            owner.__dict__["_lab_native_plan"] = plan
        plan.checked = checked
    return plan if plan.params else None


def _plan(model) -> _Plan | None:
    return _current(model, _sources, _build_plan)


def _attention_shape(attn: nn.Module) -> tuple[int, int, int, float]:
    """The op's attention arguments of a layer's attention module: heads, kv heads, head dim, scaling."""
    config = attn.config
    return config.num_attention_heads, config.num_key_value_heads, attn.head_dim, float(attn.scaling)


def _takes(model, embeds: torch.Tensor, cache) -> bool:
    """Whether this forward is one the op computes exactly (module docstring)."""
    batch, tokens = embeds.shape[:2]
    if batch != 1 or embeds.device.type != "cpu" or embeds.dtype not in invariance.REDUCED:
        return False
    if tokens > 1 and not invariance._ROWWISE.get():
        return False  # prefill and unconstrained multi-token forwards take SDPA
    if model.config._attn_implementation != invariance.ATTENTION or not getattr(model, "_lab_rows_invariant", False):
        return False
    return _plain_cache(model, cache)


def _plain_cache(model, kv) -> bool:
    """A DynamicCache of one sequence in plain tensors, every layer filled (the op's caches)."""
    if type(kv) is not DynamicCache or kv.offloading or len(kv.layers) != len(model.model.layers):
        return False
    return all(type(layer) is DynamicLayer and layer.is_initialized for layer in kv.layers) and (
        kv.layers[0].keys.shape[0] == 1
    )


def decoder_layers(model, embeds, cache, position_embeddings, mask, record: bool):
    """(final-norm hidden states [1, T, H], per-layer outputs or None) with `cache` extended, or None when this
    forward is not one the op takes (the caller runs the Python loop)."""
    if os.environ.get(SWITCH, "1") == "0" or not _takes(model, embeds, cache) or not available():
        return None
    plan = _plan(model)
    if plan is None:
        return None
    attn = model.model.layers[0].self_attn
    tokens = embeds.shape[1]
    hidden_keys = invariance._hidden_keys(mask, tokens, cache.get_seq_length() + tokens)
    cos, sin = position_embeddings
    layers = cache.layers
    normed, keys, values, recorded = torch.ops.decoding_lab.decoder_layers(
        embeds,
        [layer.keys for layer in layers],
        [layer.values for layer in layers],
        cos,
        sin,
        hidden_keys,
        plan.params,
        plan.spec,
        *_attention_shape(attn),
        plan.eps,
        record,
        lanes(),
    )
    for layer, key, value in zip(layers, keys, values, strict=True):
        layer.keys, layer.values = key, value
    return normed, (recorded if record else None)


def _takes_steps(model, embeds: torch.Tensor, caches: list) -> bool:
    """Whether a batch of one-token decode steps, one per cache, is one the op computes exactly."""
    if embeds.shape[1] != 1 or embeds.device.type != "cpu" or embeds.dtype not in invariance.REDUCED:
        return False
    if model.config._attn_implementation != invariance.ATTENTION or not getattr(model, "_lab_rows_invariant", False):
        return False
    return all(_plain_cache(model, kv) for kv in caches)


def decode_steps(model, embeds: torch.Tensor, caches: list, position_embeddings) -> torch.Tensor | None:
    """The final-norm hidden states [B, 1, H] of B one-token decode steps in one call, sequence b fed embeds[b]
    after its own `caches[b]` (each extended), or None when the op does not take them (the caller steps each
    sequence alone). The products run over all B rows at once (each weight block unpacked once for the batch) and
    every step of the layer is row by row, so row b is bit for bit `decoder_layers` of sequence b alone."""
    if os.environ.get(SWITCH, "1") == "0" or not _takes_steps(model, embeds, caches) or not available():
        return None
    plan = _plan(model)
    if plan is None:
        return None
    attn = model.model.layers[0].self_attn
    layers = range(len(model.model.layers))
    cos, sin = position_embeddings
    normed, keys, values, _ = torch.ops.decoding_lab.decoder_layers(
        embeds,
        [kv.layers[layer].keys for layer in layers for kv in caches],
        [kv.layers[layer].values for layer in layers for kv in caches],
        cos,
        sin,
        None,
        plan.params,
        plan.spec,
        *_attention_shape(attn),
        plan.eps,
        False,
        lanes(),
    )
    batch = len(caches)
    for layer in layers:
        for row, kv in enumerate(caches):
            entry = layer * batch + row
            kv.layers[layer].keys, kv.layers[layer].values = keys[entry], values[entry]
    return normed


def _draft_sources(layer: nn.Module) -> tuple:
    """`_sources` of one draft-head layer: its post-attention norm's weight and its linears and activation."""
    parts = layer._modules
    attn, mlp = parts["self_attn"]._modules, parts["mlp"]._modules
    return (
        parts["post_attention_layernorm"]._parameters["weight"],
        *(attn[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(mlp[name] for name in ("gate_proj", "up_proj", "down_proj", "act_fn")),
    )


def _build_draft_plan(layer: nn.Module, sources: tuple) -> _Plan | None:
    norm = layer.post_attention_layernorm
    params, spec = [norm.weight], []
    if not _layer_linears(layer, params, spec):
        return None
    return _Plan(sources, params, [int(v) for v in spec], float(norm.variance_epsilon))


def _draft_plan(layer: nn.Module) -> _Plan | None:
    return _current(layer, _draft_sources, _build_draft_plan)


def draft_layer(layer: nn.Module, residual, attention_input, cache, position_embeddings, mask) -> torch.Tensor | None:
    """The output [1, T, H] of a draft head's decoder layer (an EAGLE-1 layer, whose input norm is the identity, or
    EAGLE-3's `midlayer`) as one call of the op's `draft_layer`, or None when the op does not take it (the caller
    runs the layer in Python): q / k / v of `attention_input` [1, T, A], the residual stream `residual` [1, T, H],
    the head's `cache` (a DynamicCache already holding the committed pairs) extended in place, the boolean `mask`
    [1, 1, T, S + T] (None: causal). Taken on a CPU in bf16 / fp16 when every linear of the layer is one the op runs
    (a head served at a low-bit precision, `lab.heads.eagle.serving_head`); a float head keeps the Python layer.
    The attention is the op's exact float64 attention where the Python layer runs SDPA: the draft distribution
    moves by that rounding, verification (and so the output) does not."""
    if os.environ.get(SWITCH, "1") == "0" or residual.device.type != "cpu" or residual.dtype not in invariance.REDUCED:
        return None
    if residual.shape[0] != 1 or type(cache) is not DynamicCache or not available():
        return None
    attn = layer.self_attn
    kv = cache.layers[attn.layer_idx]
    if type(kv) is not DynamicLayer or not kv.is_initialized or kv.keys.dim() != 4 or kv.keys.dtype != residual.dtype:
        return None
    plan = _draft_plan(layer)
    if plan is None:
        return None
    tokens = residual.shape[1]
    hidden_keys = invariance._hidden_keys(mask, tokens, kv.keys.shape[-2] + tokens)
    cos, sin = position_embeddings
    out, kv.keys, kv.values = torch.ops.decoding_lab.draft_layer(
        residual,
        attention_input,
        kv.keys,
        kv.values,
        cos,
        sin,
        hidden_keys,
        plan.params,
        plan.spec,
        *_attention_shape(attn),
        plan.eps,
        lanes(),
    )
    return out


if __name__ == "__main__":  # `python -m lab.engine.native_forward`: build the op ahead of first use
    ok = build(verbose="-v" in sys.argv)
    print("native decoder layers:", "built" if ok else "unavailable (the Python forward will be used)")
    sys.exit(0 if ok else 1)
