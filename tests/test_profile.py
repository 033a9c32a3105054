"""The module-level profile behind `bench --profile` (`lab.engine.profile`), on tiny random models."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from lab.engine.profile import OUTSIDE, TARGET, TARGET_PIECES, format_profile, module_timer, profile_row, section
from lab.speculative.params import tree_settings
from lab.speculative.proposers.medusa import MedusaProposer
from lab.speculative.tree import tree_loop
from strategies import collect
from strategies.greedy import GreedyParams
from strategies.greedy import run as greedy_run
from strategies.medusa import TreeParams
from tests.test_medusa import random_heads
from tests.tiny import tiny_loaded_model

PROMPT = list(b"profile me")


def test_greedy_spends_its_module_time_in_one_position_target_forwards() -> None:
    loaded = tiny_loaded_model(0)
    hooks_before = len(nn.modules.module._global_forward_hooks)
    with module_timer(loaded) as times:
        events = collect(greedy_run(loaded, PROMPT, GreedyParams(max_new_tokens=6), torch.Generator()))
    assert len(nn.modules.module._global_forward_hooks) == hooks_before  # removed on exit
    assert set(times.seconds) == {TARGET}  # submodules of the target are not counted twice
    assert times.target_positions[0] == len(PROMPT) and set(times.target_positions[1:]) == {1}
    assert times.calls[TARGET] == len(times.target_positions)
    tokens = sum(1 for e in events if type(e).__name__ == "TokenEmitted")
    row = profile_row("greedy", wall_s=10 * times.seconds[TARGET], new_tokens=tokens, runs=[times])
    assert sum(row.shares.values()) == pytest.approx(1.0)
    assert row.shares[TARGET] == pytest.approx(0.1) and row.shares[OUTSIDE] == pytest.approx(0.9)
    assert row.positions_per_target_forward == 1.0
    assert row.target_forwards_per_token == pytest.approx(len(times.target_positions) / tokens)


def test_medusa_rounds_verify_trees_and_time_their_head_separately() -> None:
    loaded = tiny_loaded_model(1)
    proposer = MedusaProposer(random_heads(loaded, seed=1), 9)
    settings = tree_settings(TreeParams(max_new_tokens=20, tree_nodes=9), "medusa")
    with module_timer(loaded) as times:
        collect(tree_loop(loaded, PROMPT, proposer, torch.Generator().manual_seed(0), settings))
    assert max(times.target_positions[1:]) > 1  # tree verification scores several positions at once
    assert set(times.seconds) == {TARGET, "draft", "accept", "KV compaction"}
    rounds = times.calls["accept"]
    assert times.calls["draft"] == rounds == times.calls["KV compaction"] == times.calls[TARGET] - 1  # + prefill


def test_sections_outside_a_timer_or_on_another_thread_are_free() -> None:
    loaded = tiny_loaded_model(0)
    with section("draft"):  # no timer: nothing to record, no error
        pass
    with module_timer(loaded) as times:
        worker = threading.Thread(target=lambda: loaded.model(input_ids=torch.tensor([PROMPT])))
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="already running"), module_timer(loaded):
            pass
    assert not times.seconds  # the other thread's forward is not timed


def test_a_module_that_wraps_the_target_is_one_outer_call() -> None:
    loaded = tiny_loaded_model(0)

    class Wrapper(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return loaded.model(input_ids=ids).logits

    with module_timer(loaded) as times, torch.inference_mode():
        Wrapper()(torch.tensor([PROMPT]))
        loaded.lm_head(torch.zeros(1, int(loaded.config.hidden_size)))
    assert dict(times.calls) == {"draft Wrapper": 1, TARGET_PIECES: 1}
    table = format_profile([profile_row("x", 1.0, 4, [times])])
    assert table.splitlines()[0].startswith("| strategy | ms / token | draft Wrapper | target pieces | other |")
    assert table.splitlines()[2].startswith("| x | 250.0 |")
