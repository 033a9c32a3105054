"""Training Medusa heads on self-distillation data with the base model frozen (`python -m lab train-heads`).

Loss (Cai et al. 2024, Sec. 2.2.1, Medusa-1 with self-distillation, Sec. 2.3.2):
    L = sum_{k=1..K} 0.8^(k-1) * CE(p_teacher(x_{t+k+1} | x_<=t+k), p_t^(k))
where p_teacher is the model's own next-token distribution stored at position t + k (its top-32, restricted to
the draft vocabulary V_d and renormalised; rows with no mass in V_d are skipped). Only W_k, b_k are trained
(AdamW, linear warm-up then cosine decay); the LM head rows stay frozen. Held out: every response to the prompts
`DistillData.held_out()` picks (a split by prompt); every `eval_every` steps the log (and the checkpoint's metrics
file) reports per-head loss and top-1 accuracy (head argmax == the teacher's argmax token) on 4096 of their rows,
and the final held-out rank accuracies give the candidate tree (`lab.heads.medusa.tune_choices`), stored in the
config. `fit` checkpoints and resumes (`lab.heads.checkpoint`).
The helpers here (targets, batches, schedule, evaluation) are shared with `lab.training.mtpc_train`.
On CPU the head and LM-head products run under bf16 autocast (about 1.3x faster here; losses and updates in fp32).
Not covered: early stopping, data larger than memory, GPU mixed precision.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lab.engine.models import LoadedModel
from lab.heads.checkpoint import Checkpoint
from lab.heads.common import draft_vocabulary
from lab.heads.medusa import rank_accuracy, residual_blocks, tune_choices
from lab.training.distill.dataset import DistillData

DECAY = 0.8  # lambda_k = 0.8^(k-1) (Cai et al. 2024)
HELD_OUT_ROWS = 4096  # held-out rows evaluated
MAX_RANK = 10  # ranks tracked for the tree
TREE_PATHS = 64
Log = Callable[[str], None]


@dataclass(frozen=True)
class Targets:
    """Per data row r and draft position k = 0..K (k = 0: the base model's own next token x_{t+1}):
    the teacher's top-k at row r + k in draft-vocabulary indices (-1 outside V_d) and probabilities (0 there),
    the teacher's argmax (model id) and the token that really followed (draft index, -1 outside V_d / past
    the end of the sequence)."""

    rows: torch.Tensor  # [N] data rows used (every row)
    soft_ids: torch.Tensor  # [N, K + 1, k] int32
    soft_probs: torch.Tensor  # [N, K + 1, k] float32
    argmax: torch.Tensor  # [N, K + 1] long, model ids, -1 past the end
    hard: torch.Tensor  # [N, K + 1] long, draft indices, -1 outside V_d or past the end
    held_out: torch.Tensor  # [N] bool


def build_targets(data: DistillData, vocab: torch.Tensor, heads: int, vocab_size: int) -> Targets:
    """Align every row with the next K + 1 positions of its sequence (`DistillData.future_rows`)."""
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    n, top = data.rows, data.topk_ids.shape[1]
    soft_ids = torch.full((n, heads + 1, top), -1, dtype=torch.int32)
    soft_probs = torch.zeros((n, heads + 1, top))
    argmax = torch.full((n, heads + 1), -1, dtype=torch.long)
    hard = torch.full((n, heads + 1), -1, dtype=torch.long)
    for k in range(heads + 1):
        rows, later = data.future_rows(k) if k else (torch.arange(n), torch.arange(n))
        ids = remap[data.topk_ids[later]]  # [n_k, top]
        soft_ids[rows, k] = ids.int()
        soft_probs[rows, k] = torch.where(ids >= 0, data.topk_probs[later], 0.0)
        argmax[rows, k] = data.topk_ids[later, 0]
        hard[rows, k] = remap[data.next_token[later]]
    held_out = data.held_out()
    return Targets(torch.arange(n), soft_ids, soft_probs, argmax, hard, held_out)


def choose_vocab(loaded: LoadedModel, data: DistillData, size: int) -> torch.Tensor:
    """V_d: the `size` most frequent response tokens (EOS always in); the full vocabulary when size is 0."""
    if size <= 0:
        return torch.arange(loaded.vocab_size)
    return draft_vocabulary(data.token_frequencies(loaded.vocab_size), size, always=loaded.eos_token_ids)


def soft_cross_entropy(logp: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per row and position: -sum_j p_j log q(id_j) / sum_j p_j; NaN-free, 0 where the teacher has no mass.
    logp [B, K, V_d], ids/probs [B, K, k] -> [B, K]."""
    gathered = logp.gather(-1, ids.long().clamp_min(0))  # [B, K, k]
    mass = probs.sum(-1)
    return -(probs * gathered).sum(-1) / mass.clamp_min(1e-9)


def batches(rows: torch.Tensor, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` random mini-batches, reshuffling after every pass over `rows`."""
    done = 0
    while done < steps:
        order = rows[torch.randperm(rows.numel(), generator=generator)]
        for start in range(0, order.numel() - batch_size + 1, batch_size):
            if done == steps:
                return
            yield order[start : start + batch_size]
            done += 1


def learning_rate(step: int, steps: int, peak: float, warmup: int = 50) -> float:
    """Linear warm-up to `peak`, then cosine decay to 10% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def fit(
    params: dict[str, torch.Tensor],
    loss_fn,
    train_rows: torch.Tensor,
    options,
    log: Log,
    report: Callable[[int], dict],
    checkpoint: Checkpoint | None = None,
) -> None:
    """AdamW over `options.epochs` passes of `train_rows`; every `options.eval_every` steps (and at the end)
    `report(step)` returns held-out metrics, logged with the train loss to the checkpoint's metrics file; the
    checkpoint is saved as often as it asks and at the end, and a run resumes from it (same batch order)."""
    steps = max(1, int(options.epochs * train_rows.numel() / options.batch_size))
    optimizer = torch.optim.AdamW(list(params.values()), lr=options.lr, weight_decay=0.0)
    checkpoint = checkpoint or Checkpoint(None, {}, log)
    first = checkpoint.restore(params, optimizer)
    generator = torch.Generator().manual_seed(options.seed)
    start, running, recent = time.perf_counter(), [], []
    if first == 0:  # the curve's starting point
        checkpoint.log_metrics({"step": 0, **report(0)})
    for step, batch in enumerate(batches(train_rows, options.batch_size, steps, generator)):
        if step < first:  # done before the interruption: same batches, skipped
            continue
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, options.lr)
        loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running.append(float(loss.detach()))
        recent.append(running[-1])
        if (step + 1) % 50 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            log(f"step {step + 1}/{steps} train loss {sum(running) / len(running):.4f} ({elapsed:.0f} s)")
            running = []
        if (step + 1) % max(options.eval_every, 1) == 0 or step + 1 == steps:
            metrics = report(step + 1)
            checkpoint.log_metrics({"step": step + 1, "train_loss": sum(recent) / len(recent), **metrics})
            recent = []
        checkpoint.maybe_save(step + 1, params, optimizer, force=step + 1 == steps)


def subsample(rows: torch.Tensor, tokens: int | None, seed: int) -> torch.Tensor:
    if tokens is None or tokens >= rows.numel():
        return rows
    generator = torch.Generator().manual_seed(seed)
    return rows[torch.randperm(rows.numel(), generator=generator)[:tokens]].sort().values


def ranks_of(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank of each target index in its row (0 = argmax); MAX_RANK where the target is outside V_d."""
    inside = target >= 0
    value = logits.gather(-1, target.clamp_min(0)[..., None])
    ranks = (logits > value).sum(-1)
    return torch.where(inside, ranks, torch.full_like(ranks, MAX_RANK))


def head_metrics(
    ranks: torch.Tensor, losses: torch.Tensor, valid: torch.Tensor, log: Log, label: str
) -> tuple[list, dict]:
    """Log per-position loss and top-1 accuracy; return (rank accuracies [K][MAX_RANK], {"loss": [K], "top1": [K]}).
    ranks/losses/valid [N, K]."""
    accuracy, parts, summary = [], [], {"loss": [], "top1": []}
    for k in range(ranks.shape[1]):
        r = ranks[valid[:, k], k]
        accuracy.append(rank_accuracy(r, MAX_RANK))
        loss = float(losses[valid[:, k], k].mean()) if r.numel() else float("nan")
        parts.append(f"head {k + 1}: loss {loss:.3f} top1 {accuracy[-1][0]:.3f} top5 {sum(accuracy[-1][:5]):.3f}")
        summary["loss"].append(round(loss, 4))
        summary["top1"].append(round(accuracy[-1][0], 4))
    log(f"{label}: " + "; ".join(parts))
    return accuracy, summary


def held_out_rows(targets: Targets, seed: int) -> torch.Tensor:
    """A fixed sample of HELD_OUT_ROWS held-out rows (sorted)."""
    return subsample(targets.rows[targets.held_out], HELD_OUT_ROWS, seed)


def train(
    loaded: LoadedModel, data: DistillData, options, log: Log, checkpoint: Checkpoint | None = None
) -> tuple[dict, dict]:
    """Train K Medusa heads; returns (tensors, config) for `lab.heads.common.save_heads`."""
    heads, hidden = options.heads, int(loaded.config.hidden_size)
    vocab = choose_vocab(loaded, data, options.draft_vocab)
    lm = loaded.lm_head.weight.detach().float().cpu()[vocab]  # [V_d, H] frozen
    targets = build_targets(data, vocab, heads, loaded.vocab_size)
    weight = torch.zeros(heads, hidden, hidden, requires_grad=True)  # W_k = 0: heads start as the LM head
    bias = torch.zeros(heads, hidden, requires_grad=True)
    valid = targets.soft_probs[:, 1:].sum(-1) > 0  # [N, K]
    train_rows = subsample(targets.rows[~targets.held_out & valid[:, 0]], options.tokens, options.seed)
    held = held_out_rows(targets, options.seed)
    log(f"draft vocabulary {vocab.numel()} ids; {train_rows.numel()} training rows, {held.numel()} held out")

    def logits_of(rows: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=loaded.device.type == "cpu"):
            logits = residual_blocks(data.hidden[rows].float(), weight, bias) @ lm.T  # [B, K, V_d]
        return logits.float()

    def loss_fn(rows: torch.Tensor) -> torch.Tensor:
        ce = soft_cross_entropy(
            logits_of(rows).log_softmax(-1), targets.soft_ids[rows, 1:], targets.soft_probs[rows, 1:]
        )
        ok = valid[rows].float()
        decay = DECAY ** torch.arange(heads, dtype=torch.float32)
        return ((ce * ok).sum(0) / ok.sum(0).clamp_min(1) * decay).sum()

    accuracy: list = []

    def report(step: int) -> dict:
        nonlocal accuracy
        ces, ranks = [], []
        with torch.no_grad():
            for chunk in held.split(256):
                logits = logits_of(chunk)
                soft = targets.soft_ids[chunk, 1:], targets.soft_probs[chunk, 1:]
                ces.append(soft_cross_entropy(logits.log_softmax(-1), *soft))
                ranks.append(ranks_of(logits, soft[0][..., 0].long()))  # the teacher's argmax in V_d (-1 outside)
        accuracy, summary = head_metrics(torch.cat(ranks), torch.cat(ces), valid[held], log, f"held out @ step {step}")
        return {"held_out": summary}

    fit({"blocks.weight": weight, "blocks.bias": bias}, loss_fn, train_rows, options, log, report, checkpoint)
    choices = tune_choices(accuracy, TREE_PATHS)
    tensors = {"blocks.weight": weight.detach(), "blocks.bias": bias.detach(), "vocab": vocab}
    config = {"heads": heads, "draft_vocab": int(vocab.numel()), "choices": [list(p) for p in choices]}
    return tensors, {**config, "rank_accuracy": accuracy}
