"""Finding the checkpoint ``--resume`` names (latest of a run, a checkpoint folder or a run folder), checking
it is complete and intact (``verify``: each rank a share of the files; a changed file is refused by name with
the newest intact checkpoint before it), and reading its meta."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_clip.checkpoint.layout import (
    MANIFEST,
    MARKER,
    META,
    POINTER,
    CheckpointError,
    CorruptCheckpointError,
    _rank,
    _step_of,
    _world,
)
from ds_clip.checkpoint.manifest import (
    first_mismatch,
    manifest_files,
)
from ds_clip.distributed import all_gather_object, broadcast_object


def resolve(run_dir: Path | None, resume: str, *, agreed: Path | None = None) -> Path:
    """The checkpoint folder named by ``--resume`` ('latest' of run_dir, a checkpoint folder, or a run folder),
    checked complete: marker present, every file of the manifest there with its size. ``agreed``: the folder
    the ranks agreed on at start (``ds_clip.models.weights.agree_start``), checked without looking "latest" up
    again: a pointer that moved since (or that this rank reads differently) cannot send one rank elsewhere."""
    flag = f"--resume {resume}"
    if agreed is not None:
        path = agreed
    elif resume == "latest":
        if run_dir is None:
            raise CheckpointError(f"{flag}: no run folder given")
        root = run_dir / "checkpoints"
        pointer = root / POINTER
        if not pointer.exists():
            raise CheckpointError(f"{flag}: no complete checkpoint in {root} ({POINTER} not found)")
        path = root / pointer.read_text().strip()
    else:
        path = Path(resume).expanduser()
        if (path / "checkpoints" / POINTER).exists():  # a run folder: its latest complete checkpoint
            path = path / "checkpoints" / (path / "checkpoints" / POINTER).read_text().strip()
        elif (path / POINTER).exists():  # a checkpoints folder
            path = path / (path / POINTER).read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{flag}: {path} is not a checkpoint folder")
    if not (path / MARKER).exists():
        raise CheckpointError(f"{flag}: {path} is a partial checkpoint (no {MARKER} marker); pick another")
    manifest_file = path / MANIFEST
    if not manifest_file.exists() or not (path / META).exists():
        raise CheckpointError(f"{flag}: {path} has no {MANIFEST}/{META}: not a ds_clip checkpoint")
    for name, entry in manifest_files(json.loads(manifest_file.read_text())).items():
        f, size = path / name, entry["bytes"]
        if not f.is_file():
            raise CheckpointError(f"{flag}: {path} is partial: {name} is missing; pick another checkpoint")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"{flag}: {path} is partial: {name} has {f.stat().st_size} bytes, the manifest says {size}"
            )
    return path


def newest_complete(ckpt_root: Path) -> Path | None:
    """The step folder with the highest step that has its COMPLETE marker (the pointer is not read)."""
    if not ckpt_root.is_dir():
        return None
    found = [
        p for p in ckpt_root.iterdir() if p.is_dir() and _step_of(p) is not None and (p / MARKER).exists()
    ]
    return max(found, key=_step_of, default=None)


def is_intact(path: Path) -> bool:
    """Complete (marker, every file of the manifest with its size) and every checksum matching (one process)."""
    try:
        resolve(None, str(path))
    except CheckpointError:
        return False
    return first_mismatch(path) is None


def newest_intact_before(path: Path) -> Path | None:
    """The newest complete checkpoint older than ``path`` in the same folder whose checksums all match."""
    step = _step_of(path)
    if step is None or not path.parent.is_dir():
        return None
    older = sorted(
        (
            p
            for p in path.parent.iterdir()
            if p.is_dir() and (_step_of(p) or -1) < step and (p / MARKER).exists()
        ),
        key=_step_of,
        reverse=True,
    )
    return next((p for p in older if is_intact(p)), None)


def verify(path: Path, flag: str) -> None:
    """Every rank calls this: each checks the checksums of its share of ``path``'s files, and all agree.
    A mismatch raises CorruptCheckpointError on every rank naming the file and, where there is one, the
    newest older checkpoint that is intact (rank 0 looks for it)."""
    found = all_gather_object(first_mismatch(path, (_rank(), _world())))
    bad = next((b for b in found if b), None)
    if bad is None:
        return
    older = broadcast_object(newest_intact_before(path) if _rank() == 0 else None, src=0)
    raise CorruptCheckpointError(
        f"{flag}: {path / bad[0]} does not match its checksum in {MANIFEST} ({bad[1]}): the file changed "
        "after it was saved (a bad copy, a disk or network error); "
        + (
            f"the newest intact checkpoint is {older}: resume from it with --resume {older}"
            if older is not None
            else "no older complete checkpoint here is intact"
        )
    )


def verify_resume(run_dir: Path, resume: str) -> None:
    """Every rank, before the engine is built: the checkpoint ``--resume`` names, checked against its
    checksums. One that cannot be found is left to ``Checkpointer.resume`` to report."""
    try:
        path = resolve(run_dir, resume)
    except CheckpointError:
        return
    verify(path, f"--resume {resume}")


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())
