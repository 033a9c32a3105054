"""Training the EAGLE draft head on self-distillation data, base model frozen (`train-heads --kind eagle`).

For every stored sequence the head reads the pairs (f_p + noise, x_{p+1}) causally and is trained on
    L = 1.0 * SmoothL1(f_hat_{p+1}, f_{p+1}) + 0.1 * CE(p_{p+1}, softmax(W_lm[V_d] f_hat_{p+1}))    (EAGLE, Sec. 4.2)
where f_{p+1} is the target's real next feature (after the final norm) and p_{p+1} the target's own
next-token distribution at p + 1 (its stored top-32, restricted to V_d and renormalised; positions with no mass
in V_d get no CE). Noise ~ U(-0.1, 0.1) on the input features, as the paper (data augmentation against the
error accumulation of drafting from its own features). The head starts as the identity f_hat_{p+1} = f_p
(`init_identity`; the paper does not say how it initialises, and from a random layer the first steps only undo
its output scale). AdamW, linear warm-up then cosine decay to 10%, gradient clipping at 0.5 (EAGLE's setting).
A batch is whole sequences (right-padded, causal mask) adding up to
about `batch_size` rows. Held out: the responses to the prompts `DistillData.held_out()` picks (split by prompt);
the log reports their regression loss, CE and top-1 / top-5 accuracy (the head's argmax over V_d equals the
target's argmax) every `eval_every` steps and at the end of every epoch, also into the checkpoint's metrics file
(checkpoints and resume: `lab.heads.checkpoint`).
On CPU the head and LM-head products run under bf16 autocast (as Medusa's trainer; losses and updates in fp32).
Deliberate difference (EAGLE-3's training-time test): the loss is unrolled for UNROLL steps. Step k feeds the
head's own step k - 1 output as the feature of the pair (f_hat_{p+k}, x_{p+k+1}), which attends to the real
pairs up to p and to its own entries of steps 1..k (exactly the draft tree's mask along a path), and is trained
on f_{p+k+1} and p_{p+k+1} with weight 0.8^k (weights normalised). At inference every depth below the first
reads predicted features; teacher forcing alone (UNROLL = 1) left the head's second-level drafts mostly
rejected on the embedded model. Not covered: GPU mixed precision, data larger than memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import DynamicCache

from lab.engine.models import LoadedModel
from lab.heads.checkpoint import Checkpoint
from lab.heads.common import draft_vocabulary
from lab.heads.eagle import EagleHead, head_tensors
from lab.training.distill.dataset import DistillData

FEATURE_WEIGHT = 1.0  # w_reg (EAGLE Sec. 4.2)
CE_WEIGHT = 0.1  # w_cls
NOISE = 0.1  # input features + U(-NOISE, NOISE)
CLIP = 0.5
UNROLL = 2  # training-time test steps (EAGLE-3): 1 = EAGLE-1's teacher-forced loss only
UNROLL_DECAY = 0.8
Log = Callable[[str], None]


@dataclass(frozen=True)
class Batch:
    features: torch.Tensor  # [B, T, H] f_p
    tokens: torch.Tensor  # [B, T] x_{p+1}
    positions: torch.Tensor  # [B, T] p
    target: torch.Tensor  # [B, T, H] f_{p+1}
    soft_ids: torch.Tensor  # [B, T, k] teacher top-k at p + 1 as V_d indices (-1 outside)
    soft_probs: torch.Tensor  # [B, T, k] their probabilities (0 outside V_d)
    valid: torch.Tensor  # [B, T] bool, a real pair (not padding)


def sequence_spans(data: DistillData) -> list[tuple[int, int, int]]:
    """(sequence id, first row, end row) of every sequence with at least two rows (one training pair)."""
    ids, counts = torch.unique_consecutive(data.sequence, return_counts=True)
    ends = counts.cumsum(0)
    spans = zip(ids.tolist(), (ends - counts).tolist(), ends.tolist(), strict=True)
    return [(s, a, b) for s, a, b in spans if b - a >= 2]


@dataclass(frozen=True)
class Rows:
    """Per data row, ready for slicing: f_p in float32 and the teacher's top-k at p as V_d indices / probs."""

    features: torch.Tensor  # [N, H]
    soft_ids: torch.Tensor  # [N, k] long, -1 outside V_d
    soft_probs: torch.Tensor  # [N, k], 0 outside V_d


def prepare_rows(data: DistillData, remap: torch.Tensor) -> Rows:
    ids = remap[data.topk_ids]
    return Rows(data.hidden.float(), ids, torch.where(ids >= 0, data.topk_probs, 0.0))


def make_batch(data: DistillData, rows: Rows, spans: list[tuple[int, int, int]]) -> Batch:
    """Right-padded pairs of whole sequences: inputs rows a..b-2, targets rows a+1..b-1."""
    width = max(b - a - 1 for _, a, b in spans)
    n, hidden, top = len(spans), rows.features.shape[1], rows.soft_ids.shape[1]
    features, target = torch.zeros(n, width, hidden), torch.zeros(n, width, hidden)
    tokens, positions = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.long)
    soft_ids, soft_probs = torch.full((n, width, top), -1, dtype=torch.long), torch.zeros(n, width, top)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for i, (_, a, b) in enumerate(spans):
        m = b - a - 1
        features[i, :m], target[i, :m] = rows.features[a : b - 1], rows.features[a + 1 : b]
        tokens[i, :m], valid[i, :m] = data.next_token[a : b - 1], True
        positions[i, :m] = data.position[a : b - 1]
        positions[i, m:] = positions[i, m - 1] + 1 + torch.arange(width - m)
        soft_ids[i, :m], soft_probs[i, :m] = rows.soft_ids[a + 1 : b], rows.soft_probs[a + 1 : b]
    return Batch(features, tokens, positions, target, soft_ids, soft_probs, valid)


def group(spans: list, batch_rows: int, generator: torch.Generator | None) -> list[list]:
    """Sequences of similar length (little padding) cut into groups of about `batch_rows` pairs; with a
    generator the lengths are jittered and the groups shuffled, so every epoch batches differently."""
    lengths = torch.tensor([b - a for _, a, b in spans], dtype=torch.float32)
    if generator is not None:
        lengths = lengths + 16 * torch.rand(len(spans), generator=generator)
    groups, current, rows = [], [], 0
    for index in lengths.argsort().tolist():
        current.append(spans[index])
        rows += spans[index][2] - spans[index][1] - 1
        if rows >= batch_rows:
            groups.append(current)
            current, rows = [], 0
    groups += [current] if current else []
    if generator is not None:
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    return groups


def shifted(x: torch.Tensor, k: int, fill: float | bool) -> torch.Tensor:
    """Column j holds x[:, j + k] (the pair k positions later), the last k columns `fill`. [B, T, ...]"""
    if k == 0:
        return x
    return torch.cat([x[:, k:], torch.full_like(x[:, :k], fill)], dim=1)


def step_losses(predicted: torch.Tensor, logits: torch.Tensor, batch: Batch, k: int) -> dict[str, torch.Tensor]:
    """Smooth L1 to f_{p+1+k}, soft CE to p_{p+1+k}, and argmax hits, over the pairs that exist k steps on."""
    valid, target = shifted(batch.valid, k, False), shifted(batch.target, k, 0.0)
    soft_ids, soft_probs = shifted(batch.soft_ids, k, -1), shifted(batch.soft_probs, k, 0.0)
    reg = F.smooth_l1_loss(predicted.float(), target, reduction="none").mean(-1)  # [B, T]
    logp = logits.float().log_softmax(-1)  # [B, T, V_d]
    mass = soft_probs.sum(-1)  # [B, T]
    ce = -(soft_probs * logp.gather(-1, soft_ids.clamp_min(0))).sum(-1) / mass.clamp_min(1e-9)
    has_ce = valid & (mass > 0)
    teacher = soft_ids[..., 0]  # the teacher's argmax as a V_d index (-1 outside)
    top5 = logp.topk(5, dim=-1).indices  # [B, T, 5]
    return {
        "reg": reg[valid].mean(),
        "ce": ce[has_ce].mean() if has_ce.any() else logp.new_zeros(()),
        "top1": (top5[..., 0] == teacher)[valid].float().mean(),
        "top5": (top5 == teacher[..., None]).any(-1)[valid].float().mean(),
    }


def losses(head: EagleHead, batch: Batch, noise: float, autocast: bool = False) -> dict[str, torch.Tensor]:
    """The unrolled loss (module docstring): step k reads the head's own step k - 1 features and attends to the
    real pairs up to p and its own entries of steps 1..k (the draft tree's mask along a path). Returns the
    decay-weighted reg and ce, and top-1 / top-5 per step ("top1" = step 0, "top1@k" = step k).
    `autocast`: the head and LM-head products in bf16 on the CPU (losses and updates stay fp32)."""
    features = batch.features
    if noise:
        features = features + (torch.rand_like(features) - 0.5) * 2 * noise
    width = features.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    cache = DynamicCache(config=head.config)
    weights = [UNROLL_DECAY**k for k in range(UNROLL)]
    out: dict[str, torch.Tensor] = {}
    for k, weight in enumerate(weights):
        mask = torch.cat([causal] + [torch.eye(width, dtype=torch.bool)] * k, dim=1)[None, None]  # [1, 1, T, (k+1)T]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            features = head(features, shifted(batch.tokens, k, 0), batch.positions + k, mask, cache)  # [B, T, H]
            logits = head.logits(features)  # [B, T, V_d]
        part = step_losses(features, logits, batch, k)
        for name in ("reg", "ce"):
            out[name] = out.get(name, 0.0) + weight / sum(weights) * part[name]
        out.update({"top1": part["top1"], "top5": part["top5"]} if k == 0 else {f"top1@{k}": part["top1"]})
    return out


@torch.no_grad()
def init_identity(head: EagleHead) -> None:
    """Start as the identity f_hat_{p+1} = f_p: FC passes the feature through, the layer's output projections
    (attention o_proj, MLP down_proj) are zero so both residual branches add nothing (like Medusa's W = 0)."""
    hidden = head.fc.out_features
    head.fc.weight.zero_()
    head.fc.weight[:, hidden:] = torch.eye(hidden)
    head.fc.bias.zero_()
    head.layer.self_attn.o_proj.weight.zero_()
    head.layer.mlp.down_proj.weight.zero_()


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to 10% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(head: EagleHead, data: DistillData, rows: Rows, held: list) -> dict[str, float]:
    """Held-out metrics without noise, weighted by pairs per batch."""
    totals, count = {}, 0
    for spans in group(held, 2048, None):
        batch = make_batch(data, rows, spans)
        n = int(batch.valid.sum())
        for name, value in losses(head, batch, 0.0).items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
        count += n
    return {name: round(value / max(count, 1), 4) for name, value in totals.items()}


def train(
    loaded: LoadedModel, data: DistillData, options, log: Log, checkpoint: Checkpoint | None = None
) -> tuple[dict, dict]:
    """Train the EAGLE head; returns (tensors, config) for `lab.heads.common.save_heads`."""
    size = options.draft_vocab if options.draft_vocab > 0 else loaded.vocab_size
    vocab = draft_vocabulary(data.token_frequencies(loaded.vocab_size), size, always=loaded.eos_token_ids)
    remap = torch.full((loaded.vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    head = EagleHead(loaded, vocab).float().train()
    init_identity(head)
    head._target["lm_weight"] = head._target["lm_weight"].float()
    spans, rows = sequence_spans(data), prepare_rows(data, remap)
    held_rows = data.held_out()
    held = [s for s in spans if bool(held_rows[s[1]])][:400]
    train_spans = [s for s in spans if not bool(held_rows[s[1]])]
    if options.tokens is not None:  # the first sequences up to `tokens` rows
        ends = torch.tensor([b - a for _, a, b in train_spans]).cumsum(0)
        train_spans = train_spans[: max(1, int((ends <= options.tokens).sum()))]
    covered = float(data.token_frequencies(loaded.vocab_size)[vocab].sum()) / data.rows
    log(
        f"draft vocabulary {vocab.numel()} ids ({covered:.1%} of response tokens); {len(train_spans)} training "
        f"sequences, {len(held)} held out"
    )
    generator = torch.Generator().manual_seed(options.seed)
    autocast = loaded.device.type == "cpu"
    per_epoch = len(group(train_spans, options.batch_size, None))
    steps = max(1, math.ceil(options.epochs * per_epoch))
    params = dict(head.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=options.lr, weight_decay=0.0)
    checkpoint = checkpoint or Checkpoint(None, {}, log)
    first = checkpoint.restore(params, optimizer)
    step, start, running = 0, time.perf_counter(), []
    while step < steps:
        for spans in group(train_spans, options.batch_size, generator):
            if step == steps:
                break
            if step < first:  # done before the interruption: same batches, skipped
                step += 1
                continue
            for group_ in optimizer.param_groups:
                group_["lr"] = learning_rate(step, steps, options.lr, warmup=max(steps // 20, 1))
            parts = losses(head, make_batch(data, rows, spans), NOISE, autocast)
            loss = FEATURE_WEIGHT * parts["reg"] + CE_WEIGHT * parts["ce"]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), CLIP)
            optimizer.step()
            running.append([float(parts[k].detach()) for k in ("reg", "ce", "top1")])
            step += 1
            if step % 20 == 0 or step == steps:
                mean = torch.tensor(running).mean(0).tolist()
                log(
                    f"step {step}/{steps} reg {mean[0]:.4f} ce {mean[1]:.3f} top1 {mean[2]:.3f} "
                    f"({time.perf_counter() - start:.0f} s)"
                )
                running = []
            if step % per_epoch == 0 or step % options.eval_every == 0 or step == steps:
                metrics = evaluate(head.eval(), data, rows, held)
                log(f"held out @ step {step}: {metrics}")
                checkpoint.log_metrics({"step": step, "held_out": metrics})
                head.train()
            checkpoint.maybe_save(step, params, optimizer, force=step == steps)
    metrics = evaluate(head.eval(), data, rows, held)
    config = {
        "draft_vocab": int(vocab.numel()),
        "layer_class": type(head.layer).__name__,
        "loss": {"feature_weight": FEATURE_WEIGHT, "ce_weight": CE_WEIGHT, "noise": NOISE},
        "held_out": metrics,
    }
    return head_tensors(head), config
