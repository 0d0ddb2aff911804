"""Checkpoints through DeepSpeed's own save/load, with a pointer that is only ever complete.

DeepSpeed writes its ``latest`` file from rank 0 before the other ranks finish, and returns
``(None, None)`` with a warning when nothing is found. ds_clip saves with ``save_latest=False``,
waits for every rank, writes a manifest of every file with its size and checksum, marks the folder
complete, then replaces ``latest_complete`` atomically; only then are older checkpoints pruned
(``--keep-checkpoints``). A resume that cannot find a complete checkpoint, finds a file of the
manifest missing or cut short, or finds another model is an error, never a silent fresh start.

Checksums (xxh3-128, about 10 GiB/s on one core): each rank hashes the files it wrote right after
DeepSpeed's checkpoint engine closes them (still in the page cache), so the work is spread over the ranks
and no file is read from disk again. ``verify`` checks them on resume (each rank a share of the files):
a byte flipped after the save (a bad copy, a disk error) is refused naming the file, where torch's zip
reader would load it silently. A save that fails (a full disk, no permission, a quota) is reported in one
line by ``SaveError``, its partial folder removed and the last complete checkpoint kept.

A checkpoint folder ``checkpoints/step_XXXXXXXX/`` holds DeepSpeed's files, ``rank{r}.json`` per rank
(data position and RNG states), ``ds_clip_meta.json`` (step, epoch, samples, run shape, model config
and parameter shapes, resolved settings), ``manifest.json`` and the ``COMPLETE`` marker.

Resume on another world size (or ZeRO stage) keeps the global batch N = W*k*m (--global-batch-size re-derives
k; with --accum-freq, change it):
ZeRO-0 fp32 keeps its whole optimizer state in one file and loads natively; any other move goes through
DeepSpeed's universal checkpoint layout (written next to the new run's checkpoints by ``universal`` from ZeRO
1-3, every optimizer state key; by ``load._stage0_to_universal`` from ZeRO-0), loaded by DeepSpeed on ZeRO-1/2
and by ds_clip on ZeRO-3 (``_load_resharded``: DeepSpeed 0.19.8's own ZeRO-3 universal load is off by ~10% of
a step on CPU, measured; see docs/checkpoints.md) and ZeRO-0. A saved state with no home in the new engine is
refused (``load.check_homes``); the resume logs one line of what it restored (``cadence.describe_resume``).

The package, by job: ``layout`` (names, tags, errors) → ``rng`` → ``manifest`` (sizes and checksums) → ``save``
→ ``find`` (what ``--resume`` names, complete and intact) → ``universal`` (a ZeRO 1-3 checkpoint in the universal
layout) → ``load`` (checks and the load) → ``cadence``
(``Checkpointer``: when the trainer saves, and its resume). ``ds_clip.checkpoint`` names what the trainer, the
export, the evaluation and users need (below); every other name is imported from its module
(``ds_clip.checkpoint.save``, ``.find``, ``.load``, ``.manifest``, ``.rng``, ``.layout``, ``.cadence``).
"""

from __future__ import annotations

from ds_clip.checkpoint.cadence import Checkpointer, CheckpointPart, epochs_done_at, on_cadence
from ds_clip.checkpoint.find import read_meta, resolve, verify
from ds_clip.checkpoint.layout import (
    MANIFEST,
    MARKER,
    META,
    POINTER,
    TAG_PREFIX,
    CheckpointError,
    CorruptCheckpointError,
    SaveError,
    tag_for,
)
from ds_clip.checkpoint.load import ResumeSettingsError, safe_load
from ds_clip.checkpoint.manifest import CHECKSUM
from ds_clip.checkpoint.save import RunFolderError, check_fresh_run_folder, save

__all__ = [
    "CHECKSUM",
    "CheckpointError",
    "CheckpointPart",
    "Checkpointer",
    "CorruptCheckpointError",
    "MANIFEST",
    "MARKER",
    "META",
    "POINTER",
    "ResumeSettingsError",
    "RunFolderError",
    "SaveError",
    "TAG_PREFIX",
    "check_fresh_run_folder",
    "epochs_done_at",
    "on_cadence",
    "read_meta",
    "resolve",
    "safe_load",
    "save",
    "tag_for",
    "verify",
]
