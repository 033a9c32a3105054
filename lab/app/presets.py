"""Named parameter sets per strategy: the Run tab's preset dropdown fills the strategy's controls from them.

Covered: `presets_for(name, params_cls)` returns "defaults" (the Params defaults, so every registered strategy,
including ones that land later, has at least one preset) followed by the curated sets below that the strategy's
Params accepts (a set naming a parameter the strategy does not declare is left out, so a renamed field never
breaks the UI; tests/test_app_logic.py checks that every curated set of a registered strategy validates).
`preset_values` gives the full parameter dict of one preset. `MODELS` is the Run tab's model picker and
`DRAFT_PAIRS` the known same-tokenizer (draft -> targets) pairs for vanilla SD and SSD, offered as
"draft model: ..." presets; a drafter whose tokenizer differs from the target's is still refused at run time
(`lab.proposers.check_same_tokenizer`). Not covered: user-saved presets.
"""

from __future__ import annotations

from typing import Any

from lab.engine.models import EMBEDDED_MODEL
from lab.params import build_params, param_specs

DEFAULTS = "defaults"

# draft model -> the targets it drafts for (same tokenizer: same vocabulary, special ids and encodings)
DRAFT_PAIRS: dict[str, tuple[str, ...]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": (
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": ("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
    "meta-llama/Llama-3.2-1B-Instruct": ("meta-llama/Llama-3.1-8B-Instruct",),
}
MODELS: list[str] = [EMBEDDED_MODEL] + [m for draft, targets in DRAFT_PAIRS.items() for m in (draft, *targets)]


def _short(spec: str) -> str:
    return spec.split("/")[-1].removesuffix("-Instruct")


def draft_presets(gamma: int) -> dict[str, dict[str, Any]]:
    """One "draft model: D (targets T1 / T2)" preset per known pair."""
    return {
        f"draft model: {_short(d)} (for {' / '.join(_short(t) for t in targets)})": {
            "drafter": "model", "draft_model": d, "gamma": gamma,
        }
        for d, targets in DRAFT_PAIRS.items()
    }  # fmt: skip


CURATED: dict[str, dict[str, dict[str, Any]]] = {
    "sample": {
        "focused (T=0.3, top-p 0.9)": {"temperature": 0.3, "top_k": 0, "top_p": 0.9},
        "creative (T=1.0, top-p 0.95)": {"temperature": 1.0, "top_k": 0, "top_p": 0.95},
        "min-p 0.1 (T=1.0)": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.1},
        "pure ancestral (T=1, no truncation)": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    },
    "dola": {
        "paper: high layers": {"mode": "dola", "dola_layers": "high", "relative_top": 0.1, "repetition_penalty": 1.2},
        "paper: low layers": {"mode": "dola", "dola_layers": "low", "relative_top": 0.1, "repetition_penalty": 1.2},
        "soft contrast (lab variant)": {"mode": "soft", "soft_alpha": 1.0},
    },
    "cfg": {
        "mild guidance (gamma 1.5)": {"gamma": 1.5, "unconditional": "last-token"},
        "strong guidance (gamma 3)": {"gamma": 3.0, "unconditional": "last-token"},
        "guidance off (gamma 1)": {"gamma": 1.0},
    },
    "mirostat": {
        "v2, tau 3 (paper default)": {"version": "v2", "tau": 3.0},
        "v2, low surprise (tau 2)": {"version": "v2", "tau": 2.0},
        "v1, tau 3": {"version": "v1", "tau": 3.0},
        "v2 vs top-k / top-p": {"version": "v2", "tau": 3.0, "compare": True},
    },
    "speculative": {
        "prompt lookup (free drafts)": {"drafter": "prompt-lookup", "gamma": 6, "max_ngram": 3},
        "self-draft, 8 layers": {"drafter": "self-draft", "draft_layers": 8, "gamma": 4},
        "adaptive gamma": {"drafter": "prompt-lookup", "adaptive": True, "gamma": 4, "gamma_max": 12},
        "sampling T=0.8 (lossless)": {"temperature": 0.8},
        **draft_presets(gamma=5),
    },
    "ssd": {
        "self-draft, fan-out 3": {"drafter": "self-draft", "gamma": 4, "fanout": 3},
        "self-draft, fan-out 1": {"drafter": "self-draft", "gamma": 4, "fanout": 1},
        **draft_presets(gamma=4),
    },
    "tot": {
        "BFS (Alg. 1)": {"search": "bfs"},
        "DFS (Alg. 2)": {"search": "dfs"},
    },
    "rlm": {
        "needle in 20k tokens": {"task": "needle", "context_tokens": 20_000},
        "count over 20k tokens": {"task": "count", "context_tokens": 20_000},
    },
}


def _valid(params_cls: type, values: dict[str, Any]) -> bool:
    names = {spec.name for spec in param_specs(params_cls)}
    return set(values) <= names


def presets_for(name: str, params_cls: type) -> list[str]:
    """Preset names for a strategy: "defaults" first, then the curated sets its Params declares."""
    curated = CURATED.get(name, {})
    return [DEFAULTS] + [label for label, values in curated.items() if _valid(params_cls, values)]


def preset_values(name: str, params_cls: type, preset: str) -> dict[str, Any]:
    """Every declared parameter's value under `preset` (unknown presets give the defaults), validated."""
    overrides = CURATED.get(name, {}).get(preset, {}) if preset != DEFAULTS else {}
    if not _valid(params_cls, overrides):
        overrides = {}
    built = build_params(params_cls, overrides)
    return {spec.name: getattr(built, spec.name) for spec in param_specs(params_cls)}
