"""Statistics shared by the losslessness tests: a chi-square check of sampled tuples against an exact joint."""

from __future__ import annotations

import math

import torch


def chi2_critical(dof: int, z: float = 3.090) -> float:
    """Upper 0.1% point of chi-square(dof) by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_joint_matches(samples: list[tuple[int, ...]], joint: torch.Tensor) -> None:
    """Chi-square of sampled tuples (pairs, triples, ...) against `joint` [V] * len(tuple), at the 0.1% level."""
    counts = torch.zeros_like(joint)
    for sample in samples:
        counts[tuple(sample)] += 1
    expected = joint.flatten() * len(samples)
    observed = counts.flatten()
    assert float(observed[expected == 0].sum()) == 0, "a pair of probability 0 was emitted"
    big = expected >= 5  # pool the rare cells into one category
    pairs = list(zip(observed[big].tolist(), expected[big].tolist(), strict=True))
    pairs.append((float(observed[~big].sum()), float(expected[~big].sum())))
    statistic = sum((o - e) ** 2 / e for o, e in pairs if e > 0)
    dof = sum(e > 0 for _, e in pairs) - 1
    assert statistic < chi2_critical(dof), f"chi2 = {statistic:.1f} > {chi2_critical(dof):.1f} (dof {dof})"
