"""Saving: every rank writes through DeepSpeed, hashes what it wrote, and rank 0 marks the folder complete
and moves the pointer; a failed write is one line (``SaveError``) and its partial folder is removed. Also the
checks of the output folder before a run starts, and pruning."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_clip.checkpoint.layout import (
    MANIFEST,
    MARKER,
    META,
    POINTER,
    SaveError,
    _rank,
    _step_of,
    _world,
    _write_json_atomic,
    optimizer_param_names,
    param_shapes,
    tag_for,
)
from ds_clip.checkpoint.manifest import (
    _manifest,
    file_checksum,
)
from ds_clip.checkpoint.rng import (
    rng_state,
)
from ds_clip.distributed import all_gather_object, broadcast_object
from ds_clip.distributed import barrier as _barrier
from ds_clip.errors import UserError


class _SaveGuard:
    """Wraps the engine's checkpoint engine for one save: hashes each file right after DeepSpeed writes it
    and turns a failed write into a recorded error. DeepSpeed's save_checkpoint has barriers between its
    writes; an exception escaping on one rank would leave the others waiting in them, so the failure is
    recorded, the rank goes on through the same barriers, and all ranks agree on it afterwards."""

    def __init__(self, engine, folder: Path, checksums: bool) -> None:
        self.engine, self.folder, self.checksums = engine, folder, checksums
        self.sums: dict[str, list] = {}
        self.error: str | None = None

    def __enter__(self) -> _SaveGuard:
        ce, engine = self.engine.checkpoint_engine, self.engine
        self._save, self._copy = ce.save, getattr(engine, "_copy_recovery_script", None)

        def save(state_dict, path):
            if self.error is None:
                self.run(lambda: self._save(state_dict, path), path)
                if self.error is None and self.checksums:
                    self.record(Path(path))

        ce.save = save
        if self._copy is not None:
            engine._copy_recovery_script = lambda save_path: self.run(
                lambda: self._copy(save_path), save_path
            )
        return self

    def __exit__(self, *exc) -> None:
        self.engine.checkpoint_engine.save = self._save
        if self._copy is not None:
            self.engine._copy_recovery_script = self._copy

    def run(self, write, path) -> None:
        try:
            write()
        except (OSError, RuntimeError) as exc:  # torch reports a failed write as RuntimeError
            if self.error is None:
                self.error = _why_write_failed(Path(path), exc)

    def record(self, path: Path) -> None:
        try:
            self.sums[str(path.relative_to(self.folder))] = [path.stat().st_size, file_checksum(path)]
        except (OSError, ValueError) as exc:
            self.error = self.error or _why_write_failed(path, exc)


def _why_write_failed(path: Path, exc: BaseException) -> str:
    """Why a write failed, in words: the OSError's errno when there is one; torch's zip writer hides it
    ("unexpected pos ..."), so then a small probe write next to the file asks the file system again."""
    import errno

    reasons = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "no permission to write",
        errno.EPERM: "no permission to write",
        errno.EROFS: "read-only file system",
        errno.EFBIG: "file too large for the file system",
    }
    code = exc.errno if isinstance(exc, OSError) else None
    if code not in reasons:
        probe = path.parent / f".ds_clip_probe.{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        except OSError as probe_exc:
            code = probe_exc.errno
        finally:
            probe.unlink(missing_ok=True)
    if code in reasons:
        reason = reasons[code]
    else:
        lines = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"
    try:
        free = shutil.disk_usage(path.parent if path.parent.exists() else path.parent.parent).free
        reason += f" ({free / 2**20:.1f} MiB free)"
    except OSError:
        pass
    return f"{path.name}: {reason}"


SaveHook = Callable[[str, int, int], None]
"""Called with (point, step, rank) at each named point of a save."""
SAVE_POINTS = ("after_shards",)
"""The points a save calls its hook at: "after_shards", every rank's own files (DeepSpeed's, its rank file, its
extra parts) written, before the checksums are gathered and rank 0 marks the folder complete."""


def save(
    engine,
    run_dir: Path,
    step: int,
    data_state: dict[str, Any],
    settings: dict[str, Any],
    *,
    meta: dict[str, Any] | None = None,
    keep: int | None = None,
    checksums: bool = True,
    write_extra: Callable[[Path], list[Path]] | None = None,
    hook: SaveHook | None = None,
) -> Path:
    """Every rank calls this. Returns the checkpoint folder; raises SaveError on every rank when any rank
    could not write its part (the partial folder is removed, ``latest_complete`` still names the last
    complete checkpoint).

    ``write_extra(path)``: writes this rank's files of state DeepSpeed does not hold (the weight EMA) into the
    folder before it is listed in the manifest and marked complete; returns them (this rank hashes them).

    ``meta`` (JSON-able, rank 0's is written) should hold epoch, samples_seen, world_size, accum_freq,
    micro_batch_size, model, model_cfg; the engine's ZeRO stage and parameter shapes are added here.
    ``checksums`` False writes sizes only (for measuring what the checksums cost). ``hook``: called at the
    named points of ``SAVE_POINTS`` (fault injection; None in a normal run).
    """
    ckpt_root = run_dir / "checkpoints"
    tag = tag_for(step)
    path = ckpt_root / tag
    if _rank() == 0 and (path / MARKER).exists():
        # Rewriting a complete step (a run resumed from an older checkpoint reaches a step saved before): the
        # pointer first moves off it, so latest_complete never names a folder that is not complete, even for
        # a kill or a full disk in the middle of this save.
        _point_before(ckpt_root, path)
        (path / MARKER).unlink()  # not complete until we say so
    _barrier()
    client = {"step": step, "settings": settings, **(meta or {})}
    with _SaveGuard(engine, path, checksums) as guard:
        engine.save_checkpoint(str(ckpt_root), tag=tag, client_state=client, save_latest=False)
        # Each rank's data position (webdataset positions differ per rank) and RNG states.
        rank_file = path / f"rank{_rank()}.json"
        guard.run(lambda: _write_json_atomic(rank_file, {"data": data_state, "rng": rng_state()}), rank_file)
        if write_extra is not None and guard.error is None:
            extra: list[Path] = []
            guard.run(lambda: extra.extend(write_extra(path)), path)
            for f in extra if guard.error is None and checksums else []:
                guard.record(f)
    full_meta = {
        "step": step,
        **(meta or {}),
        "world_size": _world(),
        "zero_stage": int(engine.zero_optimization_stage()),
        "param_shapes": param_shapes(engine.module),
        "optimizer_param_names": optimizer_param_names(engine),
        "settings": settings,
    }
    if hook is not None:
        hook("after_shards", step, _rank())
    # Sync point: every rank's files are closed; rank 0 learns their checksums (and any rank's failure).
    written = all_gather_object({"sums": guard.sums, "error": guard.error})
    error = next((f"rank {r}: {w['error']}" for r, w in enumerate(written) if w["error"]), None)
    if error is None and _rank() == 0:
        sums = {name: v for w in written for name, v in w["sums"].items()} if checksums else None
        try:
            _write_json_atomic(path / META, full_meta)
            _write_json_atomic(path / MANIFEST, _manifest(path, sums))
            (path / MARKER).write_text(str(step))
            tmp = ckpt_root / f".{POINTER}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, ckpt_root / POINTER)
        except OSError as exc:
            error = f"rank 0: {_why_write_failed(path / MANIFEST, exc)}"
    error = broadcast_object(error, src=0)
    if error is not None:
        if _rank() == 0:
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            (ckpt_root / f".{POINTER}.tmp").unlink(missing_ok=True)
        _barrier()
        last = (ckpt_root / POINTER).read_text().strip() if (ckpt_root / POINTER).exists() else None
        raise SaveError(
            f"checkpoint {tag} could not be saved to {path}: {error}; removed the partial folder, "
            + (f"the last complete checkpoint {last} is kept" if last else "no earlier complete checkpoint")
        )
    if _rank() == 0 and keep is not None:
        prune(ckpt_root, keep, newest=step)
    _barrier()
    return path


def _point_before(ckpt_root: Path, path: Path) -> None:
    """Rank 0: when latest_complete names ``path``, point it at the newest complete checkpoint before it
    (atomically), or remove it when there is none."""
    pointer = ckpt_root / POINTER
    if not pointer.exists() or pointer.read_text().strip() != path.name:
        return
    step = _step_of(path)
    older = [
        p
        for p in ckpt_root.iterdir()
        if p.is_dir() and (_step_of(p) if _step_of(p) is not None else step) < step and (p / MARKER).exists()
    ]
    if not older:
        pointer.unlink()
        return
    tmp = ckpt_root / f".{POINTER}.tmp"
    tmp.write_text(max(older, key=_step_of).name)
    os.replace(tmp, pointer)


def remove_partial(ckpt_root: Path) -> list[Path]:
    """Delete checkpoint folders without the COMPLETE marker (a save that was cut short). Rank 0 only."""
    removed = []
    if ckpt_root.is_dir():
        for p in sorted(ckpt_root.iterdir()):
            if p.is_dir() and _step_of(p) is not None and not (p / MARKER).exists():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def estimate_bytes(num_params: int, precision: str) -> int:
    """One checkpoint: working weights + fp32 master + two AdamW moments (summed over ranks), +10%."""
    working = 4 if precision == "fp32" else 2
    master = 0 if precision == "fp32" else 4
    return int(num_params * (working + master + 8) * 1.1) + (1 << 20)


def check_output_space(run_dir: Path, num_params: int, precision: str) -> None:
    """Refuse to start when the output disk cannot hold one checkpoint (every rank checks its view)."""
    need = estimate_bytes(num_params, precision)
    free = shutil.disk_usage(run_dir if run_dir.exists() else run_dir.parent).free
    if free < need:
        raise OutputError(
            f"--logs {run_dir.parent}: {free / 2**20:.1f} MiB free, one checkpoint of this model needs about "
            f"{need / 2**20:.1f} MiB; free some space or point --logs elsewhere"
        )


def check_writable(logs: Path) -> None:
    """--logs must be a folder we can create and write into, before any process group starts."""
    try:
        logs.mkdir(parents=True, exist_ok=True)
        probe = logs / f".ds_clip_write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"--logs {logs} is not a writable folder: {exc.strerror or exc}") from exc


class OutputError(UserError):
    """The output folder cannot take the run (not writable, too little space)."""

    same_on_every_rank = False  # --logs can be a different disk on each host: every rank says what it found


def check_fresh_run_folder(run_dir: Path, name: str) -> None:
    """A run started without --resume must not write into a run folder that holds checkpoints: it would mix
    its steps with the old run's and repoint latest_complete at them. One line naming the folder and the two
    ways out (open_clip refuses a reused --name too)."""
    root = run_dir / "checkpoints"
    tags = (
        sorted((p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of)
        if root.is_dir()
        else []
    )
    if not tags and not (root / POINTER).exists():
        return
    latest = f", the latest {tags[-1].name}" if tags else ""
    raise RunFolderError(
        f"--name {name}: the run folder {run_dir} already holds checkpoints ({len(tags)}{latest}); continue "
        f"that run with --resume latest, or start a new one with another --name"
    )


class RunFolderError(UserError):
    """A new run named like an existing one (its folder holds checkpoints) without --resume."""


# How long a node's first rank looks for rank 0's file: a network file system may show a new file on other nodes
# a moment after it was written (attribute caching); a folder local to each node never shows it.
SHARED_FOLDER_WAIT_S = 10.0


def check_shared_run_folder(run_dir: Path, logs: Path, *, local_rank: int) -> None:
    """Every rank calls this once the run folder exists (rank 0 made it): rank 0 writes a file with a random
    token into it, the first rank of every node reads it back. A node that does not see it has a ``--logs``
    folder of its own, and there every checkpoint would be split between the nodes' disks (DeepSpeed writes
    each rank's part where that rank runs) with nothing saying so until a resume fails: RunFolderError, on
    every rank, naming the node, before the model is built. Two small collectives (none on one rank).
    """
    if _world() == 1:
        return
    token = secrets.token_hex(16) if _rank() == 0 else None
    probe = None
    if _rank() == 0:
        probe = run_dir / f".ds_clip_shared.{token}"
        probe.write_text(token)
    token = broadcast_object(token, src=0)  # after rank 0's write: the file exists wherever it is visible
    seen = None  # this rank's verdict; only the first rank of each node (other than rank 0's) looks
    if local_rank == 0 and _rank() != 0:
        mine = run_dir / f".ds_clip_shared.{token}"
        deadline = time.monotonic() + SHARED_FOLDER_WAIT_S
        while True:  # polls a file for a bounded time: a shared file system may show it late
            try:
                seen = mine.read_text() == token
            except OSError:
                seen = False
            if seen or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    verdicts = all_gather_object((socket.gethostname(), seen))
    if probe is not None:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (host, ok) in enumerate(verdicts) if ok is False]
    if blind:
        r, host = blind[0]
        others = f" (and {len(blind) - 1} more node(s))" if len(blind) > 1 else ""
        raise RunFolderError(
            f"--logs {logs}: rank {r} on {host}{others} does not see the run folder {run_dir} that rank 0 on "
            f"{verdicts[0][0]} writes into, so each node has a --logs folder of its own and every checkpoint "
            "would be split between their disks; give --logs a folder on a file system all nodes share (a "
            "shared or network file system; --remote-sync uploads from rank 0's node only and needs it too)"
        )


def prune(ckpt_root: Path, keep: int, newest: int | None = None) -> list[Path]:
    """Delete checkpoints older than the newest ``keep`` complete ones (complete or partial); return them.

    Only called after a newer checkpoint is complete, so at least one complete checkpoint always stays.
    ``newest``: the step just saved. Folders of later steps belong to a history the run left (it resumed from
    an older step) and neither count among the kept ones nor are deleted: by step number alone, the abandoned
    steps would be kept and the run's own new checkpoints deleted.
    """
    folders = sorted(
        (
            p
            for p in ckpt_root.iterdir()
            if p.is_dir() and _step_of(p) is not None and (newest is None or _step_of(p) <= newest)
        ),
        key=_step_of,
    )
    complete = [p for p in folders if (p / MARKER).exists()]
    if len(complete) <= keep:
        return []
    oldest_kept = _step_of(complete[-keep])
    gone = [p for p in folders if _step_of(p) < oldest_kept]
    for p in gone:
        # The marker goes first: a deletion cut short leaves a folder that reads as partial, not complete.
        (p / MARKER).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return gone
