"""Import boundaries of docs/architecture.md section 2: visualizers and lab.trace never pull in torch or gradio; the
engine (lab) and the strategies never pull in gradio. Each check runs in a fresh interpreter so earlier imports in the
test session cannot hide a violation."""

from __future__ import annotations

import ast
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
    engine = [
        "lab.engine.models",
        "lab.engine.runtime",
        "lab.engine.sampling",
        "lab.app.runner",
        "lab.app.validation",
        "strategies",
    ]
    assert _loaded_modules(engine, ["gradio"]) == []


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports (absolute names, statically, anywhere in the file: deferred imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_nothing_under_lab_imports_strategies() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in _imported_modules(path) if m.split(".")[0] == "strategies")
        for path in (ROOT / "lab").rglob("*.py")
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}


def test_no_strategy_imports_another() -> None:
    names = {path.stem for path in (ROOT / "strategies").glob("*.py") if path.stem != "__init__"}
    offenders = {}
    for path in (ROOT / "strategies").glob("*.py"):
        if path.stem == "__init__":  # the package discovers its modules by name, it imports none statically
            continue
        mods = sorted(m for m in _imported_modules(path) if m.split(".")[0] == "strategies")
        if mods:
            offenders[path.stem] = mods
    assert offenders == {} and "speculative" in names and "ssd" in names


# docs/architecture.md section 2: each package of lab/ and the lab packages it may import (besides its own).
CONTRACT = {"lab.params", "lab.trace"}
ENGINE = CONTRACT | {"lab.engine"}
MIDDLE = ENGINE | {"lab.registry", "lab.speculative", "lab.methods", "lab.heads"}
EVERYTHING = MIDDLE | {"lab.training", "lab.app", "lab.tools"}
ALLOWED = {
    "lab.params": set(),
    "lab.trace": set(),
    "lab.engine": CONTRACT,
    "lab.registry": ENGINE,
    "lab.heads": ENGINE,
    "lab.speculative": ENGINE | {"lab.heads"},
    "lab.methods": ENGINE | {"lab.registry", "lab.speculative"},
    "lab.training": EVERYTHING,
    "lab.app": EVERYTHING - {"lab.training", "lab.tools"},
    "lab.tools": EVERYTHING,
}


def _lab_package(module: str) -> str | None:
    """'lab.engine.models' -> 'lab.engine'; 'lab.trace' -> 'lab.trace'; None outside lab or for `lab` itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "lab" and len(parts) > 1 else None


def _layer_violations(root: Path) -> dict[str, list[str]]:
    """file -> the lab packages it imports that its own package may not (ALLOWED)."""
    found = {}
    for path in sorted((root / "lab").rglob("*.py")):
        own = _lab_package(".".join(path.relative_to(root).with_suffix("").parts))
        if own is None or own in ("lab.__init__", "lab.__main__"):
            continue
        allowed = ALLOWED[own] | {own}
        imported = {_lab_package(m) for m in _imported_modules(path)} - {None}
        bad = sorted(package for package in imported if package not in allowed)
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def test_every_lab_module_is_in_a_known_package() -> None:
    packages = {_lab_package(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in (ROOT / "lab").rglob("*.py")}
    assert packages - {None, "lab.__init__", "lab.__main__"} == set(ALLOWED)


def test_lab_packages_import_only_downwards() -> None:
    """The engine imports only the contracts; speculative, methods and heads never import the app or the tools."""
    assert _layer_violations(ROOT) == {}


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "lab" / "engine").mkdir(parents=True)
    (tmp_path / "lab" / "engine" / "runtime.py").write_text("def f():\n    from lab.app.runner import run\n")
    assert _layer_violations(tmp_path) == {"lab/engine/runtime.py": ["lab.app"]}


def _import_cycle(package: Path, name: str) -> list[str]:
    """A cycle among the modules of one package (deferred imports included), or [] when their imports form a DAG."""
    modules = {f"{name}.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"}
    edges = {m: sorted(i for i in _imported_modules(p) if i in modules and i != m) for m, p in modules.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str]:
        state[module] = "open"
        for target in edges[module]:
            if state.get(target) == "open":
                return [*path, module, target]
            if target not in state and (cycle := visit(target, [*path, module])):
                return cycle
        state[module] = "done"
        return []

    for module in sorted(modules):
        if module not in state and (cycle := visit(module, [])):
            return cycle
    return []


def test_visualizer_modules_do_not_import_each_other_in_a_circle() -> None:
    assert _import_cycle(ROOT / "visualizers", "visualizers") == []


def test_the_cycle_check_sees_a_deferred_circle(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.a import g\n")
    assert _import_cycle(tmp_path, "pkg") in (["pkg.a", "pkg.b", "pkg.a"], ["pkg.b", "pkg.a", "pkg.b"])


def test_the_boundary_checks_can_fail(tmp_path: Path) -> None:
    """The import scan sees deferred and `from` imports, so a violation cannot hide in a function body."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from strategies.medusa import run\n    import strategies.ssd\n")
    assert {"strategies.medusa", "strategies.ssd", "strategies.medusa.run"} <= _imported_modules(sample)
