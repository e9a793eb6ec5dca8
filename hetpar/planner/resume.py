"""Re-planning a run for another cluster: which checkpoint the new plan's program resumes from.

A checkpoint written by the program of one plan is loaded by the program of any plan of
the same model ([Note: resharding resume] in runtime/checkpoint.py), so re-planning needs
no conversion: the new plan is searched as usual, and this module only checks that the
checkpoint directory holds a checkpoint of this model and says which step it continues
from (``hetpar plan --resume-from``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetpar.planner.errors import PlanningError
from hetpar.runtime.checkpoint import CheckpointError, resume_point
from hetpar.runtime.model_file import load_model_file


@dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """The checkpoint a new plan's program will resume from."""

    path: Path
    step: int
    world_size: int  # processes of the run that wrote it
    run: dict[str, Any]  # what that run recorded: optimizer, seed, global_batch_size

    def describe(self, checkpoint_dir: Path, global_batch_size: int) -> str:
        """One line: the step it continues from and how to run the new plan's program."""
        optimizer = self.run.get("optimizer")
        option = f" --optimizer {optimizer}" if optimizer else ""
        processes = f"{self.world_size} process{'es' if self.world_size != 1 else ''}"
        line = (f"continues from step {self.step} ({self.path}, written by {processes}): compile this "
                f"plan and run it with --checkpoint-dir {checkpoint_dir}{option}; it trains from step {self.step + 1}")
        before = self.run.get("global_batch_size")
        if before is not None and before != global_batch_size:
            line += (f" (the checkpoint's run had global batch {before}, this plan {global_batch_size}: the data from "
                     "then on differs from an uninterrupted run's)")
        return line


def find_resume_point(model_file: Path, model_args: dict[str, Any], checkpoint_dir: Path) -> ResumePoint:
    """The newest complete checkpoint in ``checkpoint_dir``, checked to be of the model that
    ``model_file`` builds (built on the meta device: nothing is allocated).

    Raises:
        PlanningError: no checkpoint there, or the newest one was written for another model.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise PlanningError(f"--resume-from {checkpoint_dir}: no such directory")
    with torch.device("meta"):
        model = load_model_file(model_file, model_args).build_model()
    try:
        found = resume_point(checkpoint_dir, model)
    except CheckpointError as exc:
        raise PlanningError(f"--resume-from: {exc}; plan the model that wrote it") from None
    if found is None:
        raise PlanningError(f"--resume-from {checkpoint_dir}: no complete checkpoint there (a directory of "
                            "step-NNNNNNNN checkpoints that a program's --checkpoint-dir wrote)")
    return ResumePoint(path=found.path, step=found.step, world_size=int(found.marker.get("world_size", 0)),
                       run=dict(found.marker.get("run") or {}))


__all__ = ["ResumePoint", "find_resume_point"]
