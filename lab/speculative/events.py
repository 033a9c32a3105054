"""Trace events of a verified round, built from the draft, the processed target rows and the acceptance (plain
Python values only, docs/architecture.md section 7): `draft_round` for chains (DraftRound, Leviathan et al. 2023's
symbols) and `tree_round` for trees (TreeRound). The residual a recovered token was drawn from comes from the acceptance
rule itself, never recomputed here. Greedy rounds of a drafter without a distribution (prompt lookup) have one-hot p
and q: their figures follow from two token ids per position, with no [n, V] tensors (`_one_hot_detail`). Equal values
are listed by token id (`lab.engine.sampling.top_tokens`' order)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lab.engine.sampling import SamplingConfig, target_distribution, top_tokens
from lab.speculative.acceptance import Acceptance
from lab.speculative.draft import Draft
from lab.trace import DraftRound, TreeRound

TOP_DETAIL = 5  # per drafted position and for the residual (DraftRound)
Text = Callable[[int], str]


def _q_rows(draft: Draft, p: torch.Tensor) -> torch.Tensor:
    """q of each drafted position on p's columns: the drafter's rows, or one-hot at the draft token. [n, V]"""
    if draft.q is not None:
        return draft.q.to(p)
    index = torch.tensor(draft.tokens, dtype=torch.long, device=p.device)[:, None]
    return torch.zeros(draft.size, p.shape[-1], dtype=p.dtype, device=p.device).scatter_(1, index, 1.0)


def _top(values: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    top = top_tokens(values, k)
    pairs = [(t, x) for t, x in zip(top.ids[0].tolist(), top.logits[0].tolist(), strict=True) if x > 0]
    return [t for t, _ in pairs], [round(x, 6) for _, x in pairs]


Detail = tuple[list, list, list, list, list]  # q_i(x_i), p_i(x_i), and per position: alternatives' ids, p, q


def _dense_detail(draft: Draft, processed: torch.Tensor, config: SamplingConfig) -> Detail:
    """q_i(x_i), p_i(x_i) and the top tokens of p + q per drafted position, from the [n, V] distributions."""
    n = draft.size
    p = target_distribution(processed[:n], config)  # [n, V], one-hot argmax in greedy mode
    q = _q_rows(draft, p)
    index = torch.tensor(draft.tokens, dtype=torch.long, device=p.device)[:, None]
    columns = top_tokens(p + q, TOP_DETAIL).ids  # [n, k]
    rows_p, rows_q = p.gather(1, columns).tolist(), q.gather(1, columns).tolist()
    alt_ids, alt_p, alt_q = [], [], []
    for row, row_p, row_q in zip(columns.tolist(), rows_p, rows_q, strict=True):
        kept = [(t, a, b) for t, a, b in zip(row, row_p, row_q, strict=True) if a + b > 0]
        alt_ids.append([t for t, _, _ in kept])
        alt_p.append([a for _, a, _ in kept])
        alt_q.append([b for _, _, b in kept])
    return q.gather(1, index)[:, 0].tolist(), p.gather(1, index)[:, 0].tolist(), alt_ids, alt_p, alt_q


def _one_hot_detail(draft: Draft, processed: torch.Tensor) -> Detail:
    """`_dense_detail` of a greedy round whose drafter gave no distribution: p_i is one-hot at the argmax b_i and
    q_i at the draft token x_i, so p + q is 2 at x_i = b_i, else 1 at both (listed by id)."""
    best = top_tokens(processed[: draft.size], 1).ids[:, 0].tolist()
    alt_ids, alt_p, alt_q = [], [], []
    for b, x in zip(best, draft.tokens, strict=True):
        ids = [x] if b == x else sorted((b, x))
        alt_ids.append(ids)
        alt_p.append([float(t == b) for t in ids])
        alt_q.append([float(t == x) for t in ids])
    return [1.0] * draft.size, [float(b == x) for b, x in zip(best, draft.tokens, strict=True)], alt_ids, alt_p, alt_q


def draft_round(
    step: int, drafter: str, gamma: int, draft: Draft, processed: torch.Tensor, config: SamplingConfig,
    acc: Acceptance, text: Text, times: tuple[float, float],
) -> DraftRound:  # fmt: skip
    """The DraftRound of one verified chain: q_i(x_i), p_i(x_i), u_i, what was kept, residual top, alternatives."""
    if not draft.size:
        q_x, p_x, alt_ids, alt_p, alt_q = [], [], [], [], []
    elif config.greedy and draft.q is None:
        q_x, p_x, alt_ids, alt_p, alt_q = _one_hot_detail(draft, processed)
    else:
        q_x, p_x, alt_ids, alt_p, alt_q = _dense_detail(draft, processed, config)
    residual_ids, residual_probs = [], []
    if acc.recovered is not None:
        residual = acc.residual if acc.residual is not None else target_distribution(processed[len(acc.path)], config)
        residual_ids, residual_probs = _top(residual, TOP_DETAIL)
    final = acc.next_token
    return DraftRound(
        step=step, drafter=drafter, gamma=gamma, draft_tokens=list(draft.tokens),
        draft_texts=[text(t) for t in draft.tokens],
        q=[round(x, 6) for x in q_x], p=[round(x, 6) for x in p_x],
        uniforms=[round(u, 6) for u in acc.uniforms], accepted=len(acc.accepted), recovered=acc.recovered,
        bonus=acc.bonus, final_text=text(final) if final is not None else "", residual_top_ids=residual_ids,
        residual_top_texts=[text(t) for t in residual_ids], residual_top_probs=residual_probs,
        alt_texts=[[text(t) for t in row] for row in alt_ids], alt_p=[[round(x, 6) for x in row] for row in alt_p],
        alt_q=[[round(x, 6) for x in row] for row in alt_q], draft_s=round(times[0], 6), verify_s=round(times[1], 6),
    )  # fmt: skip


def tree_round(
    step: int, method: str, mode: str, root: int, draft: Draft, processed: torch.Tensor, acc: Acceptance,
    emitted: int, text: Text, times: tuple[float, float],
) -> TreeRound:  # fmt: skip
    """The TreeRound of a verified tree (node indices relative to the draft: the root is not a node)."""
    parents, depths = draft.tree_parents, draft.depths
    p = []
    if draft.size:
        parent_rows = sorted({x + 1 for x in parents})  # the log-sum-exp of the rows some node is drawn from
        lse = torch.logsumexp(processed[parent_rows], dim=-1)  # [parents]
        rows = torch.tensor([x + 1 for x in parents], dtype=torch.long, device=processed.device)
        at = torch.tensor([parent_rows.index(x + 1) for x in parents], dtype=torch.long, device=processed.device)
        columns = torch.tensor(draft.tokens, dtype=torch.long, device=processed.device)
        p = (processed[rows, columns] - lse[at]).exp().tolist()
    top_ids, top_probs = draft.top_ids or [], draft.top_probs or []
    next_token = acc.next_token if acc.next_token is not None else draft.tokens[acc.path[-1]]
    return TreeRound(
        step=step, method=method, mode=mode, root_token=root, root_text=text(root), tokens=list(draft.tokens),
        texts=[text(t) for t in draft.tokens], parents=parents, depths=depths, heads=list(depths),
        ranks=list(draft.ranks or [0] * draft.size), q=[round(draft.q_of(i), 6) for i in range(draft.size)],
        p=[round(x, 6) for x in p], accepted=list(acc.path), next_token=next_token, next_text=text(next_token),
        next_source=acc.source, emitted=emitted, head_top_ids=top_ids,
        head_top_texts=[[text(t) for t in row] for row in top_ids], head_top_probs=top_probs,
        draft_s=round(times[0], 6), verify_s=round(times[1], 6),
    )  # fmt: skip


def sources_of(n_accepted: int, last: str) -> list[str]:
    """Per emitted token of a round: 'accepted' for the kept draft tokens, then the last token's source."""
    return ["accepted"] * n_accepted + [last]
