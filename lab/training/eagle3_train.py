"""Training an EAGLE-3 head (`lab.heads.eagle3`) on self-distillation data, target frozen (`train-heads --kind eagle3`).

Li et al. 2025 (EAGLE-3, Sec. 3): the head reads g_p = FC([l_p; m_p; h_p]), the fused inputs of target layers
2, L // 2 and L - 3 (stored by `lab distill --layers eagle3`), drafts tokens, not features (no feature regression
loss), and is trained with the training-time test: step 0 reads (g_p, x_{p+1}) for every real pair of a sequence
(causal), step k = 1..unroll-1 reads the head's own step k - 1 output o in place of g at the same column, with the
token x_{p+k+1}, position p + k, attending the real pairs up to p and its own entries of steps 1..k (the draft
tree's mask along a path; `lab.training.eagle_train.losses` builds the same masks for EAGLE-1). Loss:
    L = sum_k 0.8^k CE(p_{p+k+1}, q_k) / sum_k 0.8^k                       (EAGLE-3 reference: ploss weights 0.8^k)
with p_{p+k+1} the target's stored top-32 at position p + k + 1 restricted to the draft vocabulary and
renormalised (positions with no mass there are skipped) and q_k = softmax(lm_head(norm(o))) over V_d.
Draft vocabulary: the `draft_vocab` most frequent response tokens (EOS in), stored as d2t / t2d
(target id = draft id + d2t[draft id]). Initialisation: `norm` and `lm_head` start as the target's final norm
and LM-head rows of V_d, and `lm_head` stays frozen (a CPU-time saving; the reference trains it); the rest is
the default init of the layers. AdamW, warm-up then cosine decay to 10%, gradient clipping at 0.5. Held out:
responses to the prompts `DistillData.held_out()` picks; every `eval_every` steps the log and the checkpoint's
metrics file get held-out CE and top-1 per step k (argmax of q_k equals the target's argmax). Checkpoints and
resume: `lab.heads.checkpoint`. The saved head is a SafeAILab-layout folder with `"lab_context": "last"` (it was
trained from the last prompt position, not the whole prompt). Not covered: GPU mixed precision, data larger than
memory, training lm_head.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

from lab.engine.models import LoadedModel
from lab.heads.checkpoint import Checkpoint
from lab.heads.common import draft_vocabulary
from lab.heads.eagle3 import Eagle3Head, build_eagle3, default_layer_ids, head_config, save_eagle3, vocab_maps
from lab.training.distill.dataset import DistillData
from lab.training.eagle_train import Batch, Rows, group, learning_rate, make_batch, sequence_spans, shifted

DECAY = 0.8
CLIP = 0.5
Log = Callable[[str], None]


def data_layers(loaded: LoadedModel) -> list[int]:
    """The features this trainer reads from the data (`load_distill(..., layers=...)`)."""
    return default_layer_ids(loaded.num_layers)


def unrolled_losses(head: Eagle3Head, batch: Batch, unroll: int, autocast: bool = False) -> dict[str, torch.Tensor]:
    """The training-time-test loss (module docstring) and top-1 per step k ("top1@k"). Batch features [B, T, 3H]."""
    width = batch.tokens.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    cache = DynamicCache(config=head.config)
    weights = [DECAY**k for k in range(unroll)]
    features, out = batch.features, {"loss": torch.zeros(())}
    for k, weight in enumerate(weights):
        mask = torch.cat([causal] + [torch.eye(width, dtype=torch.bool)] * k, dim=1)[None, None]  # [1, 1, T, (k+1)T]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            features = head(features, shifted(batch.tokens, k, 0), batch.positions + k, mask, cache, fused=k == 0)
            logits = head.logits(features)  # [B, T, V_d]
        valid = shifted(batch.valid, k, False)
        soft_ids, soft_probs = shifted(batch.soft_ids, k, -1), shifted(batch.soft_probs, k, 0.0)
        logp = logits.float().log_softmax(-1)
        mass = soft_probs.sum(-1)  # [B, T]
        ce = -(soft_probs * logp.gather(-1, soft_ids.clamp_min(0))).sum(-1) / mass.clamp_min(1e-9)
        scored = valid & (mass > 0)
        step_ce = ce[scored].mean() if scored.any() else logp.new_zeros(())
        out["loss"] = out["loss"] + weight / sum(weights) * step_ce
        out[f"ce@{k}"] = step_ce.detach()
        out[f"top1@{k}"] = (logp.argmax(-1) == soft_ids[..., 0])[valid].float().mean()
    return out


def fused_rows(data: DistillData, layers: list[int], remap: torch.Tensor) -> Rows:
    """[l; m; h] per data row (fp16, cast per batch) and the teacher's top-k as V_d indices / probabilities."""
    ids = remap[data.topk_ids]
    fused = torch.cat([data.features[layer] for layer in sorted(layers)], dim=-1)  # [N, 3H] fp16
    return Rows(fused, ids, torch.where(ids >= 0, data.topk_probs, 0.0))


def new_head(loaded: LoadedModel, vocab: torch.Tensor) -> tuple[Eagle3Head, dict]:
    """A fresh head with d2t / t2d for `vocab`, norm and lm_head from the target (module docstring)."""
    config = head_config(loaded.config, int(vocab.numel()), lab_context="last")
    head = build_eagle3(config, loaded.embeddings).float().train()
    d2t, t2d = vocab_maps(vocab, loaded.vocab_size)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.norm.weight.copy_(loaded.final_norm.weight.detach().float().cpu())
        head.lm_head.weight.copy_(loaded.lm_head.weight.detach().float().cpu()[vocab])
    head.lm_head.weight.requires_grad_(False)
    return head, config


@torch.no_grad()
def evaluate(head: Eagle3Head, data: DistillData, rows: Rows, held: list, unroll: int) -> dict[str, float]:
    """Held-out CE and top-1 per step, weighted by pairs per batch."""
    totals, count = {}, 0
    head.eval()
    for spans in group(held, 2048, None):
        batch = make_batch(data, rows, spans)
        n = int(batch.valid.sum())
        for name, value in unrolled_losses(head, batch, unroll).items():
            totals[name] = totals.get(name, 0.0) + float(value) * n
        count += n
    head.train()
    return {name: round(value / max(count, 1), 4) for name, value in totals.items()}


def train(
    loaded: LoadedModel, data: DistillData, options, log: Log, checkpoint: Checkpoint | None = None
) -> tuple[Eagle3Head, dict]:
    """Train the EAGLE-3 head; returns (head, config) for `save`."""
    size = options.draft_vocab if options.draft_vocab > 0 else loaded.vocab_size
    vocab = draft_vocabulary(data.token_frequencies(loaded.vocab_size), size, always=loaded.eos_token_ids)
    remap = torch.full((loaded.vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    head, config = new_head(loaded, vocab)
    rows, spans = fused_rows(data, head.layer_ids, remap), sequence_spans(data)
    held_rows = data.held_out()
    held = [s for s in spans if bool(held_rows[s[1]])][:400]
    train_spans = [s for s in spans if not bool(held_rows[s[1]])]
    log(
        f"EAGLE-3: layers {head.layer_ids}, draft vocabulary {vocab.numel()} ids, unroll {options.unroll}; "
        f"{len(train_spans)} training sequences, {len(held)} held out"
    )
    params = {name: p for name, p in head.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(list(params.values()), lr=options.lr, weight_decay=0.0)
    checkpoint = checkpoint or Checkpoint(None, {}, log)
    first = checkpoint.restore(params, optimizer)
    per_epoch = len(group(train_spans, options.batch_size, None))
    steps = max(1, math.ceil(options.epochs * per_epoch))
    generator = torch.Generator().manual_seed(options.seed)
    step, start, recent = 0, time.perf_counter(), []
    if first == 0:  # the curve's starting point
        log(f"held out @ step 0: {evaluate(head, data, rows, held, options.unroll)}")
    while step < steps:
        for spans_ in group(train_spans, options.batch_size, generator):
            if step == steps:
                break
            step += 1
            if step <= first:  # done before the interruption: same batches, skipped
                continue
            for group_ in optimizer.param_groups:
                group_["lr"] = learning_rate(step - 1, steps, options.lr, warmup=max(steps // 20, 1))
            parts = unrolled_losses(head, make_batch(data, rows, spans_), options.unroll, loaded.device.type == "cpu")
            optimizer.zero_grad(set_to_none=True)
            parts["loss"].backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
            optimizer.step()
            recent.append([float(parts["loss"].detach()), float(parts["top1@0"])])
            if step % 20 == 0 or step == steps:
                mean = torch.tensor(recent[-20:]).mean(0).tolist()
                elapsed = time.perf_counter() - start
                log(f"step {step}/{steps} loss {mean[0]:.4f} top1@0 {mean[1]:.3f} ({elapsed:.0f} s)")
            if step % options.eval_every == 0 or step == steps:
                metrics = evaluate(head, data, rows, held, options.unroll)
                log(f"held out @ step {step}: {metrics}")
                train_loss = sum(r[0] for r in recent) / max(len(recent), 1)
                checkpoint.log_metrics({"step": step, "train_loss": train_loss, "held_out": metrics})
                recent = []
            checkpoint.maybe_save(step, params, optimizer, force=step == steps)
    config["held_out"] = evaluate(head, data, rows, held, options.unroll)
    config["loss"] = {"ce_decay": DECAY, "unroll": options.unroll, "lm_head": "frozen, target rows of V_d"}
    return head.eval(), config


def save(stem: Path, head: Eagle3Head, config: dict) -> tuple[Path, Path]:
    """The SafeAILab-layout folder `stem`/ (config.json + model.safetensors); returns (weights, config) paths."""
    folder = save_eagle3(stem, head, config)
    return folder / "model.safetensors", folder / "config.json"
