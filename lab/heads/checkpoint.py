"""Training that survives an interruption: periodic checkpoints, `--resume`, and a metrics log for the curves.

`Checkpoint(path, every_s, fingerprint)` saves {step, trainable tensors, optimizer state, fingerprint} with
`torch.save` to `path` atomically (write then rename) at most every `every_s` seconds and when asked (`force`).
`restore` loads it back into the same tensors and optimizer and returns the step to continue from; a checkpoint
made with other options or data (its `fingerprint`, e.g. the training options and the data rows) is refused.
Mini-batches are drawn from a generator seeded by the options, so a resumed run replays the batch order and
skips the steps already done: the resumed run takes the same steps as an uninterrupted one.
`log_metrics` appends one JSON line per evaluation to `<path>.metrics.jsonl` (step, time, train loss,
held-out loss and top-1 per head), the data behind the accuracy curves. Not covered: several workers, GPU RNG.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lab.params import InputError

Log = Callable[[str], None]
EVERY_S = 300.0  # at most 5 minutes of work lost


class Checkpoint:
    """One training run's checkpoint file and metrics log (module docstring); `path` None: neither."""

    def __init__(self, path: Path | None, fingerprint: dict, log: Log, every_s: float = EVERY_S) -> None:
        self.path, self.fingerprint, self.log, self.every_s = path, json.loads(json.dumps(fingerprint)), log, every_s
        self.last = time.monotonic()

    @property
    def metrics_path(self) -> Path | None:
        return self.path.with_suffix(".metrics.jsonl") if self.path else None

    def restore(self, tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
        """Load the checkpoint into `tensors` and `optimizer` (in place); the step to continue from (0: none)."""
        if self.path is None or not self.path.is_file():
            if self.path is not None:
                self.log(f"no checkpoint at {self.path}: starting from step 0")
            return 0
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        if state["fingerprint"] != self.fingerprint:
            raise InputError(
                f"The checkpoint {self.path} was made with other options or data ({state['fingerprint']}); "
                "delete it or train without --resume."
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                tensor.copy_(state["tensors"][name])
        optimizer.load_state_dict(state["optimizer"])
        self.log(f"resumed from {self.path} at step {state['step']}")
        return int(state["step"])

    def maybe_save(
        self, step: int, tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, force: bool = False
    ) -> bool:
        """Save when `every_s` has passed since the last save (or `force`); True when it saved."""
        if self.path is None or not (force or time.monotonic() - self.last >= self.every_s):
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "step": step,
            "fingerprint": self.fingerprint,
            "tensors": {name: t.detach().clone() for name, t in tensors.items()},
            "optimizer": optimizer.state_dict(),
        }
        partial = self.path.with_suffix(".partial")
        torch.save(state, partial)
        os.replace(partial, self.path)
        self.last = time.monotonic()
        self.log(f"checkpoint at step {step}: {self.path}")
        return True

    def log_metrics(self, record: dict) -> None:
        if self.metrics_path is None:
            return
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps({"time": time.strftime("%H:%M:%S"), **record}) + "\n")
