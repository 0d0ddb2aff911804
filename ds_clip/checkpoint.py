"""Checkpoints through DeepSpeed's own save/load, with a pointer that is only ever complete.

DeepSpeed writes its ``latest`` file from rank 0 before the other ranks finish, and returns
``(None, None)`` with a warning when nothing is found. ds_clip saves with ``save_latest=False``,
waits for every rank, marks the folder complete, then replaces ``latest_complete`` atomically; a
resume that cannot find a complete checkpoint is an error, never a silent fresh start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

POINTER = "latest_complete"
MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, partial or unreadable."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(engine, run_dir: Path, step: int, data_state: dict[str, Any], settings: dict[str, Any]) -> Path:
    """Every rank calls this. Returns the checkpoint folder."""
    ckpt_root = run_dir / "checkpoints"
    tag = f"step_{step:08d}"
    engine.save_checkpoint(
        str(ckpt_root), tag=tag, client_state={"step": step, "settings": settings}, save_latest=False
    )
    path = ckpt_root / tag
    # Each rank's data position (webdataset positions differ per rank).
    (path / f"data_rank{_rank()}.json").write_text(json.dumps(data_state))
    _barrier()
    if _rank() == 0:
        (path / MARKER).write_text(str(step))
        tmp = ckpt_root / f".{POINTER}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, ckpt_root / POINTER)
    _barrier()
    return path


def resolve(run_dir: Path, resume: str) -> Path:
    if resume == "latest":
        pointer = run_dir / "checkpoints" / POINTER
        if not pointer.exists():
            raise CheckpointError(f"--resume latest: no complete checkpoint in {run_dir / 'checkpoints'}")
        path = run_dir / "checkpoints" / pointer.read_text().strip()
    else:
        path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: {path} is not a checkpoint folder")
    if not (path / MARKER).exists():
        raise CheckpointError(
            f"--resume {resume}: {path} is a partial checkpoint (no {MARKER} marker); pick another"
        )
    return path


def load(engine, run_dir: Path, resume: str) -> dict[str, Any]:
    """Every rank calls this; returns {'step', 'data', 'path'}."""
    path = resolve(run_dir, resume)
    data_file = path / f"data_rank{_rank()}.json"
    if not data_file.exists():
        raise CheckpointError(
            f"--resume {resume}: {data_file.name} missing in {path} (saved on fewer ranks?)"
        )
    try:
        load_path, client = engine.load_checkpoint(str(path.parent), tag=path.name)
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"--resume {resume}: cannot load {path}: {exc}") from exc
    if load_path is None:
        raise CheckpointError(f"--resume {resume}: DeepSpeed found no checkpoint in {path}")
    return {"step": int(client["step"]), "data": json.loads(data_file.read_text()), "path": str(path)}
