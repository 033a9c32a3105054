"""`python -m lab train-heads --kind medusa|mtpc|eagle`: train draft heads on self-distillation data, base frozen.

Each kind has a trainer module `lab.heads.<kind>_train` exposing
`train(loaded, data, options, log) -> (tensors, config)`; this module loads the model and the data
(`lab.distill.dataset.load_distill`), seeds torch, runs the trainer and saves the heads with
`lab.heads.common.save_heads` (config gets `kind`, `model_shape` and the training settings added).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.params import InputError

KINDS = ("medusa", "mtpc", "eagle")


@dataclass(frozen=True)
class TrainOptions:
    """Settings every trainer understands (a trainer may ignore some); recorded in the head's config."""

    tokens: int | None = None  # use at most this many data rows (None: all)
    epochs: float = 1.0
    lr: float = 1e-3
    batch_size: int = 256
    draft_vocab: int = 8192  # frequency-ranked draft vocabulary size (0: the full vocabulary)
    seed: int = 0
    heads: int = 4  # K for medusa / mtpc
    components: int = 4  # r for mtpc


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch

    from lab.cli import _int_option
    from lab.distill.cli import DEFAULT_OUT
    from lab.distill.dataset import load_distill
    from lab.heads.common import HEADS_DIR, model_shape, model_slug, save_heads
    from lab.models import load_model

    try:
        options = TrainOptions(
            tokens=_int_option("--tokens", args.tokens),
            epochs=float(args.epochs),
            lr=float(args.lr),
            batch_size=_int_option("--batch-size", args.batch_size),
            draft_vocab=_int_option("--draft-vocab", args.draft_vocab),
            seed=_int_option("--seed", args.seed),
            heads=_int_option("--heads", args.heads),
            components=_int_option("--components", args.components),
        )
    except ValueError as error:
        raise InputError(f"Bad training option: {error}") from None
    if not (0 < options.epochs <= 100 and 0 < options.lr < 1 and options.batch_size >= 1):
        raise InputError("--epochs must be in (0, 100], --lr in (0, 1), --batch-size at least 1.")
    if not (1 <= options.heads <= 8 and 1 <= options.components <= 64):
        raise InputError("--heads must be 1..8 and --components 1..64.")
    folders = args.data.split(",") if args.data else [DEFAULT_OUT.format(slug=model_slug(args.model))]
    data = load_distill([folder.strip() for folder in folders if folder.strip()])
    loaded = load_model(args.model, args.device, "float32" if args.dtype == "auto" else args.dtype)
    if data.config["model_shape"] != model_shape(loaded):
        raise InputError(f"The data was made with a model of shape {data.config['model_shape']}, not {args.model}.")
    torch.manual_seed(options.seed)
    trainer = importlib.import_module(f"lab.heads.{args.kind}_train")
    _log(f"training {args.kind} heads on {data.rows} rows ({options})")
    tensors, config = trainer.train(loaded, data, options, _log)
    config = {**config, "kind": args.kind, "model_shape": model_shape(loaded), "training": asdict(options)}
    config["data"] = data.config
    stem = Path(args.out) / args.kind if args.out else HEADS_DIR / model_slug(loaded.spec) / args.kind
    weights, _ = save_heads(stem, tensors, config)
    _log(f"saved {weights} ({weights.stat().st_size / 1e6:.1f} MB)")
    return 0


def register(commands, evaluations, add_model_options) -> None:
    """Add `train-heads` to the top-level commands."""
    parser = commands.add_parser("train-heads", help="train Medusa / MTPC / EAGLE draft heads (base model frozen)")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument(
        "--data", default=None, help="self-distillation data folder(s), comma-separated (default data/distill/<model>)"
    )
    parser.add_argument("--out", default=None, help="output folder (default heads/<model>/, the shipped heads)")
    parser.add_argument("--tokens", default=None, help="train on at most N data rows (default: all)")
    parser.add_argument("--epochs", default="1", help="passes over the data (fractions allowed)")
    parser.add_argument("--lr", default="1e-3", help="AdamW learning rate")
    parser.add_argument("--batch-size", default="256", help="rows per optimizer step")
    parser.add_argument("--draft-vocab", default="8192", help="frequency-ranked draft vocabulary size (0: full)")
    parser.add_argument("--heads", default="4", help="K, tokens drafted per step (medusa, mtpc)")
    parser.add_argument("--components", default="4", help="r, mixture components (mtpc)")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_train_heads)
