"""`python -m lab train-heads --kind medusa|mtpc|eagle|eagle3`: train draft heads on self-distillation data, base
frozen.

Each kind has a trainer module `lab.training.<kind>_train` exposing
`train(loaded, data, options, log, checkpoint) -> (tensors, config)`; this module loads the model and the data
(`lab.training.distill.dataset.load_distill`; for eagle3 also the fused features), seeds torch, runs the trainer and
saves the heads with `lab.heads.common.save_heads` (config gets `kind`, `model_shape` and the training settings added).
Folders of token ids (`lab.training.distill.store`, committed under heads/data/) get their features from a
teacher-forced pass cached outside git (`lab.training.distill.features`; `--features-*` options).
The trainer checkpoints to `--checkpoint` (default `<out>/<kind>.ckpt`; for the shipped folder
heads/checkpoints/<model>/<kind>.ckpt, tracked, when all the data is committed ids, else data/checkpoints/...)
every `--checkpoint-every` seconds; `--resume` continues from it (`lab.heads.checkpoint`), and its `.metrics.jsonl`
holds the held-out curves.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.params import InputError

KINDS = ("medusa", "mtpc", "eagle", "eagle3")
CHECKPOINTS_DIR = Path(__file__).resolve().parents[2] / "heads" / "checkpoints"  # tracked: runs on committed data


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
    rank: int = 32  # rho, rank of mtpc's per-(k, z) adapters
    warm_start: bool = True  # mtpc: per-position blocks from this model's shipped Medusa heads
    eval_every: int = 200  # steps between held-out evaluations (logged, and in the checkpoint's metrics file)
    unroll: int = 4  # eagle3: training-time test steps


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _recompute(args: argparse.Namespace, folders: list[str], layers):
    """For ids folders (`lab.training.distill.store`): a function giving their shards with features recomputed by
    the model at --features-precision / --features-dtype (default: those the ids were generated with), cached in
    --features-cache (`lab.training.distill.features`)."""
    import json

    from lab.engine.models import load_model
    from lab.training.distill.features import DEFAULT_CACHE, folder_features
    from lab.training.distill.store import is_ids_folder

    ids = [Path(folder) for folder in folders if is_ids_folder(Path(folder))]
    if not ids:
        return None
    config = json.loads((ids[0] / "config.json").read_text())
    precision = args.features_precision or config["precision"]
    dtype = args.features_dtype or config["dtype"]
    teacher = load_model(args.model, args.device, dtype, precision)
    cache = Path(args.features_cache) if args.features_cache else DEFAULT_CACHE
    _log(f"features of {', '.join(map(str, ids))}: {teacher.spec}, {teacher.precision}, {teacher.dtype}, cache {cache}")

    def recompute(folder: Path) -> list:
        top_k = json.loads((folder / "config.json").read_text())["settings"]["top_k"]
        return folder_features(teacher, folder, top_k, layers, _log, cache, recompute=not args.no_recompute)

    return recompute


def cmd_train_heads(args: argparse.Namespace) -> int:
    import torch

    from lab.engine.models import load_model
    from lab.heads.checkpoint import Checkpoint
    from lab.heads.common import HEADS_DIR, model_shape, model_slug, save_heads
    from lab.tools.cli import _int_option
    from lab.training.distill.cli import DEFAULT_OUT
    from lab.training.distill.dataset import load_distill
    from lab.training.distill.store import is_ids_folder

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
            rank=_int_option("--rank", args.rank),
            warm_start=not args.no_warm_start,
            eval_every=_int_option("--eval-every", args.eval_every),
            unroll=_int_option("--unroll", args.unroll),
        )
        every_s = float(args.checkpoint_every)
    except ValueError as error:
        raise InputError(f"Bad training option: {error}") from None
    if not (0 < options.epochs <= 100 and 0 < options.lr < 1 and options.batch_size >= 1):
        raise InputError("--epochs must be in (0, 100], --lr in (0, 1), --batch-size at least 1.")
    if not (1 <= options.heads <= 8 and 1 <= options.components <= 64 and 1 <= options.rank <= 1024):
        raise InputError("--heads must be 1..8, --components 1..64 and --rank 1..1024.")
    if not (1 <= options.unroll <= 16 and options.eval_every >= 1 and every_s > 0):
        raise InputError("--unroll must be 1..16, --eval-every at least 1 and --checkpoint-every positive.")
    folders = args.data.split(",") if args.data else [DEFAULT_OUT.format(slug=model_slug(args.model))]
    folders = [folder.strip() for folder in folders if folder.strip()]
    loaded = load_model(args.model, args.device, "float32" if args.dtype == "auto" else args.dtype)
    trainer = importlib.import_module(f"lab.training.{args.kind}_train")
    layers = getattr(trainer, "data_layers", lambda _: ())(loaded)
    data = load_distill(folders, layers=layers, recompute=_recompute(args, folders, layers))
    if data.config["model_shape"] != model_shape(loaded):
        raise InputError(f"The data was made with a model of shape {data.config['model_shape']}, not {args.model}.")
    torch.manual_seed(options.seed)
    stem = Path(args.out) / args.kind if args.out else HEADS_DIR / model_slug(loaded.spec) / args.kind
    tracked = all(is_ids_folder(Path(folder)) for folder in folders)  # committed data: a committable checkpoint
    checkpoints = CHECKPOINTS_DIR if tracked else Path("data/checkpoints")
    default_checkpoint = checkpoints / model_slug(loaded.spec) / args.kind if not args.out else stem
    path = Path(args.checkpoint) if args.checkpoint else default_checkpoint.with_suffix(".ckpt")
    fingerprint = {"kind": args.kind, "options": asdict(options), "data": folders, "rows": data.rows}
    fingerprint["options"].pop("eval_every")
    if not args.resume and path.exists():
        path.unlink()  # a fresh run: the old checkpoint and curves go
        path.with_suffix(".metrics.jsonl").unlink(missing_ok=True)
    checkpoint = Checkpoint(path, fingerprint, _log, every_s)
    _log(f"training {args.kind} heads on {data.rows} rows ({options}); checkpoints in {path}")
    tensors, config = trainer.train(loaded, data, options, _log, checkpoint)
    config = {**config, "kind": args.kind, "model_shape": model_shape(loaded), "training": asdict(options)}
    config["data"] = data.config
    weights, _ = getattr(trainer, "save", save_heads)(stem, tensors, config)
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
    parser.add_argument("--rank", default="32", help="rho, rank of the per-component adapters (mtpc)")
    parser.add_argument("--no-warm-start", action="store_true", help="mtpc: do not start from the Medusa heads")
    parser.add_argument("--unroll", default="4", help="eagle3: training-time test steps")
    parser.add_argument("--eval-every", default="200", help="steps between held-out evaluations")
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (default <out>/<kind>.ckpt)")
    parser.add_argument("--checkpoint-every", default="300", help="seconds between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint (same options and data)")
    parser.add_argument("--features-precision", default=None, help="ids data: precision of the feature pass")
    parser.add_argument("--features-dtype", default=None, help="ids data: dtype of the feature pass")
    parser.add_argument("--features-cache", default=None, help="ids data: feature cache folder")
    parser.add_argument("--no-recompute", action="store_true", help="ids data: a stale feature cache is an error")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_train_heads)
