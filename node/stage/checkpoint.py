"""Stage checkpoints on disk, for the checkpoint-restart baseline CheckFree is compared with.

A checkpoint is one frame file (``protocol.frames``: the same versioned, checked format as
the wire, so loading one never unpickles anything): the stage's weights and Adam moments as
tensors, the step and sample counters as fields. Written atomically (temp file, rename), one
per stage in ``recovery.checkpoint_dir``, overwritten by each save. Not a feature for volunteers:
with checkpoint-restart every node must reach the directory (shared storage), which is the
baseline's cost.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from protocol.frames import Limits, decode_frame, encode_frame


def checkpoint_path(directory: str | Path, stage: int) -> Path:
    return Path(directory) / f"stage{stage}.mrmr"


def save_checkpoint(
    directory: str | Path, stage: int, tensors: dict[str, torch.Tensor], step: int, samples: int
) -> Path:
    """Write the stage's state; returns the file."""
    path = checkpoint_path(directory, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffers = encode_frame(
        "checkpoint", {"stage": stage, "step": step, "samples": samples}, tensors
    )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        for b in buffers:
            f.write(b)
    os.replace(tmp, path)
    return path


def load_checkpoint(
    directory: str | Path, stage: int
) -> tuple[Mapping[str, torch.Tensor], int, int] | None:
    """``(tensors, step, samples)`` of the stage's last save, or None if there is none."""
    path = checkpoint_path(directory, stage)
    if not path.is_file():
        return None
    msg_type, fields, tensors = decode_frame(bytearray(path.read_bytes()), Limits())
    if msg_type != "checkpoint" or fields.get("stage") != stage:
        raise ValueError(f"{path} is not a checkpoint of stage {stage}")
    return tensors, int(fields["step"]), int(fields["samples"])
