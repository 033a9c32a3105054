"""Import boundaries of DESIGN.md section 2: visualizers and lab.trace never pull in torch or gradio; the engine
(lab) and the strategies never pull in gradio. Each check runs in a fresh interpreter so earlier imports in the
test session cannot hide a violation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _loaded_modules(imports: list[str], watched: list[str]) -> list[str]:
    """Import `imports` in a fresh interpreter rooted at the repository; return which of `watched` got loaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {imports!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(','.join(m for m in {watched!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return [m for m in done.stdout.strip().split(",") if m]


def test_visualizers_import_neither_torch_nor_gradio() -> None:
    assert _loaded_modules(["visualizers"], ["torch", "gradio"]) == []


def test_trace_does_not_import_torch() -> None:
    assert _loaded_modules(["lab.trace"], ["torch", "gradio"]) == []


def test_engine_and_strategies_do_not_import_gradio() -> None:
    engine = ["lab.models", "lab.runtime", "lab.sampling", "lab.runner", "lab.validation", "strategies"]
    assert _loaded_modules(engine, ["gradio"]) == []
