"""Training an MTPC circuit (`lab.heads.mtpc`) on self-distillation data, base model frozen (`train-heads --kind mtpc`).

Loss per row (Grivas et al. 2025: maximum likelihood of the next tokens under the circuit, plus Medusa's
marginal distillation so that r = 1 reduces to the Medusa objective):
    L = -log sum_z pi_z prod_{k=0..K} p_{k,z}(y_k) / n_valid  +  sum_{k=1..K} 0.8^(k-1) CE(p_teacher,k, q_k)
where y_k is the token that really followed at position t + k + 1 in the data (positions outside V_d or past the
end of the sequence are left out of the product), n_valid the number of positions kept, and
q_k = sum_z pi_z p_{k,z} the circuit's marginal. Same data, vocabulary, optimiser and schedule as
`lab.training.medusa_train` (shared helpers). The held-out log reports both the marginal top-1 (what independent
heads can reach) and the conditional top-1 given the true prefix and root, q_k(. | y_0..y_{k-1}) (what the joint
adds); the conditional rank accuracies give the candidate tree.
Warm start (option `warm_start`, on by default): when this model's Medusa heads exist (`heads/<model>/medusa.*`,
same K and draft vocabulary), the per-position blocks W_k, b_k start from them (logged and recorded as
`warm_start` in the config), so MTPC training adds the mixture on top of Medusa's training instead of repeating it.
Off (`--no-warm-start`), every r starts from the same `init_tensors` draw: the fair comparison of r = 1, r = 4,
r = 8 and a fully factorised baseline of the same parameter count (r = 1 with `rank` = 4 x 32, same data,
schedule and epochs). Held-out split by prompt and checkpoints as in `lab.training.medusa_train`.
Not covered: EM training, HMM-style circuits, components with separate LM-head copies.
"""

from __future__ import annotations

import torch

from lab.engine.models import LoadedModel
from lab.heads.checkpoint import Checkpoint
from lab.heads.common import HEADS_DIR, find_heads, load_heads
from lab.heads.medusa import tune_choices
from lab.heads.mtpc import init_tensors, mtpc_logits
from lab.params import InputError
from lab.training.distill.dataset import DistillData
from lab.training.medusa_train import (
    DECAY,
    TREE_PATHS,
    Log,
    build_targets,
    choose_vocab,
    fit,
    head_metrics,
    held_out_rows,
    ranks_of,
    soft_cross_entropy,
    subsample,
)

EVAL_CHUNK = 128


def log_leaves_at(logits: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p_{k,z}(ids) without materialising the log-softmax: logits [B, P, r, V_d], lse [B, P, r], ids [B, P, m]
    -> [B, P, r, m]."""
    r = logits.shape[2]
    return logits.gather(-1, ids.long().clamp_min(0)[:, :, None, :].expand(-1, -1, r, -1)) - lse[..., None]


def circuit_loss_terms(log_pi: torch.Tensor, logits: torch.Tensor, hard: torch.Tensor, soft_ids: torch.Tensor):
    """(joint log-likelihood of the observed tokens [B], log q_k at the teacher's ids [B, K, m]).

    log_pi [B, r], logits [B, K + 1, r, V_d], hard [B, K + 1] (V_d indices, -1 = left out), soft_ids [B, K, m].
    """
    lse = torch.logsumexp(logits, dim=-1)  # [B, K + 1, r]
    observed = log_leaves_at(logits, lse, hard[:, :, None])[..., 0] * (hard >= 0)[:, :, None]  # [B, K + 1, r]
    joint = torch.logsumexp(log_pi + observed.sum(1), dim=-1)
    marginal = torch.logsumexp(log_pi[:, None, :, None] + log_leaves_at(logits[:, 1:], lse[:, 1:], soft_ids), dim=2)
    return joint, marginal


@torch.no_grad()
def circuit_distributions(log_pi: torch.Tensor, logits: torch.Tensor, hard: torch.Tensor):
    """Full log marginals q_k and log conditionals q_k(. | y_0..y_{k-1}) for evaluation. [B, K, V_d] each."""
    logp = torch.log_softmax(logits, dim=-1)
    r = logp.shape[2]
    observed = logp.gather(-1, hard.clamp_min(0)[:, :, None, None].expand(-1, -1, r, 1))[..., 0]  # [B, K + 1, r]
    observed = observed * (hard >= 0)[:, :, None]
    marginal = torch.logsumexp(log_pi[:, None, :, None] + logp[:, 1:], dim=2)  # [B, K, V_d]
    prefix = torch.cumsum(observed, dim=1)[:, :-1]  # [B, K, r]: sum over j < k of log p_{j,z}(y_j)
    weights = torch.log_softmax(log_pi[:, None, :] + prefix, dim=-1)  # log w_z(y_<k)
    conditional = torch.logsumexp(weights[..., None] + logp[:, 1:], dim=2)  # [B, K, V_d]
    return marginal, conditional


def warm_start(loaded: LoadedModel, tensors: dict, vocab: torch.Tensor, log: Log) -> str | None:
    """Copy the per-position blocks W_k, b_k from this model's Medusa heads (same K and V_d), if there are any."""
    try:
        medusa, _ = load_heads("medusa", loaded)
    except InputError:
        log("no Medusa heads to warm-start from: the per-position blocks start at zero")
        return None
    weight = tensors["blocks.weight"]
    if medusa["blocks.weight"].shape != weight.shape or not torch.equal(medusa["vocab"].cpu(), vocab):
        log("the Medusa heads differ in K or draft vocabulary: no warm start")
        return None
    with torch.no_grad():
        weight.copy_(medusa["blocks.weight"].cpu())
        tensors["blocks.bias"].copy_(medusa["blocks.bias"].cpu())
    stem = find_heads("medusa", loaded)
    source = str(stem.relative_to(HEADS_DIR.parent) if stem.is_relative_to(HEADS_DIR.parent) else stem)
    log(f"warm start: per-position blocks from {source}")
    return source


def train(
    loaded: LoadedModel, data: DistillData, options, log: Log, checkpoint: Checkpoint | None = None
) -> tuple[dict, dict]:
    """Train a K-position, r-component circuit; returns (tensors, config) for `save_heads`."""
    heads, hidden = options.heads, int(loaded.config.hidden_size)
    vocab = choose_vocab(loaded, data, options.draft_vocab)
    lm = loaded.lm_head.weight.detach().float().cpu()[vocab]  # [V_d, H] frozen
    targets = build_targets(data, vocab, heads, loaded.vocab_size)
    fresh = init_tensors(heads, options.components, options.rank, hidden)
    tensors = {name: t.requires_grad_() for name, t in fresh.items()}
    source = warm_start(loaded, tensors, vocab, log) if options.warm_start else None
    valid = targets.soft_probs[:, 1:].sum(-1) > 0  # [N, K]
    train_rows = subsample(targets.rows[~targets.held_out & valid[:, 0]], options.tokens, options.seed)
    held = held_out_rows(targets, options.seed)
    decay = DECAY ** torch.arange(heads, dtype=torch.float32)
    log(f"draft vocabulary {vocab.numel()} ids, r = {options.components}; {train_rows.numel()} training rows")

    def leaves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=loaded.device.type == "cpu"):
            log_pi, logits = mtpc_logits(data.hidden[rows].float(), tensors, lm)
        return log_pi.float(), logits.float()

    def loss_fn(rows: torch.Tensor) -> torch.Tensor:
        hard, (soft_ids, soft_probs) = targets.hard[rows], _soft(targets, rows)
        joint, marginal = circuit_loss_terms(*leaves(rows), hard, soft_ids)
        nll = -(joint / (hard >= 0).sum(-1).clamp_min(1)).mean()
        ce = -(soft_probs * marginal).sum(-1) / soft_probs.sum(-1).clamp_min(1e-9)  # [B, K]
        ok = valid[rows].float()
        return nll + ((ce * ok).sum(0) / ok.sum(0).clamp_min(1) * decay).sum()

    accuracy: list = []

    def report(step: int) -> dict:
        nonlocal accuracy
        parts: dict[str, list] = {"ce": [], "marginal": [], "conditional": []}
        with torch.no_grad():
            for chunk in held.split(EVAL_CHUNK):
                marginal, conditional = circuit_distributions(*leaves(chunk), targets.hard[chunk])
                greedy = targets.soft_ids[chunk, 1:, 0].long()  # the teacher's argmax in V_d
                parts["ce"].append(soft_cross_entropy(marginal, *_soft(targets, chunk)))
                parts["marginal"].append(ranks_of(marginal, greedy))
                parts["conditional"].append(ranks_of(conditional, greedy))
        ce = torch.cat(parts["ce"])
        _, marginal = head_metrics(torch.cat(parts["marginal"]), ce, valid[held], log, f"held out @ {step}, marginal")
        conditional = torch.cat(parts["conditional"])
        accuracy, summary = head_metrics(conditional, ce, valid[held], log, f"held out @ {step}, conditional")
        return {"held_out": summary, "held_out_marginal": marginal}

    fit(tensors, loss_fn, train_rows, options, log, report, checkpoint)
    choices = tune_choices(accuracy, TREE_PATHS)
    saved = {name: t.detach() for name, t in tensors.items()} | {"vocab": vocab}
    config = {"heads": heads, "components": options.components, "rank": options.rank, "draft_vocab": int(vocab.numel())}
    config["warm_start"] = source
    return saved, {**config, "choices": [list(p) for p in choices], "rank_accuracy": accuracy}


def _soft(targets, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return targets.soft_ids[rows, 1:], targets.soft_probs[rows, 1:]
