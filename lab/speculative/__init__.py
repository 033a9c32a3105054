"""The speculative core (docs/architecture.md section 6): vanilla SD, SSD, EAGLE, Medusa and MTPC share it and differ
only in the proposer and the scheduling.

- `draft`: one `Draft` (a chain, or a tree by parent indices; q per node or None), `DraftContext`, the
  `Proposer` contract and `Verified` (what a proposer learns after a round).
- `verify`: one target forward over [root] + draft (chain: causal; tree: tree mask), the KV commit.
- `acceptance`: accepted / recovered / bonus: Leviathan Alg. 1 for chains, the SpecInfer / EAGLE-2 sibling rule
  for trees, greedy walks, Medusa's typical acceptance (lossy).
- `chain`: the chain loop (`chain_loop`, with a schedule: serial, or SSD's); `tree`: the tree loop (`tree_loop`).
- `events`: DraftRound / TreeRound and the sources of a round's tokens; the TokenEmitted stream is
  `lab.engine.emitter` (shared with the autoregressive loop).
- `proposers/`: prompt lookup, draft model, self-draft, Medusa, MTPC, EAGLE, SSD's speculator.
Device discipline: tensors made here live on the device of the logits they work with; generators on the model's.
"""
