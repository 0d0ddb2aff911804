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
ZeRO-0 fp32 keeps its whole optimizer state in one file and loads natively; ZeRO-1/2 go through
DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, written next to the
new run's checkpoints); ZeRO-3 takes the same universal per-parameter files, written into this
rank's partitions by ``_load_resharded`` (DeepSpeed 0.19.8's own ZeRO-3 universal load is off by
~10% of a step on CPU, measured; see docs/checkpoints.md).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ds_clip import faults
from ds_clip.config import CheckpointSettings
from ds_clip.distributed import all_gather_object, broadcast_object, rank, world_size
from ds_clip.distributed import barrier as _barrier
from ds_clip.errors import RunError, UserError
from ds_clip.geometry import BatchGeometry

logger = logging.getLogger("ds_clip")

POINTER = "latest_complete"
MARKER = "COMPLETE"
META = "ds_clip_meta.json"
MANIFEST = "manifest.json"
TAG_PREFIX = "step_"
UNIVERSAL_PREFIX = "universal_from_"


class CheckpointError(RunError):
    """A checkpoint that is missing, partial, unreadable or from an incompatible run."""


class CorruptCheckpointError(UserError):
    """A checkpoint file whose bytes differ from the checksum the manifest recorded at save time."""


class SaveError(RunError):
    """A checkpoint that could not be written (no space, no permission, a quota): its partial folder is gone,
    the last complete checkpoint stays."""


class ResumeSettingsError(UserError):
    """A resume whose optimizer flags differ from the checkpoint's: the load would silently undo them."""


# Optimizer hyperparameters a resume cannot change: DeepSpeed's load restores each parameter group's lr,
# weight_decay, betas and eps from the optimizer state, and the LR scheduler's state restores every group's
# peak (base_lrs). A changed flag would be parsed, logged, and then overwritten by the old value. The
# schedule's shape (--warmup, --lr-scheduler, --epochs...) is rebuilt from the flags and does take effect.
# --opt too: the optimizer state of one optimizer is no state of another (a checkpoint without the key is from
# before --opt, i.e. AdamW).
RESUME_FIXED = ("lr", "visual_lr", "text_lr", "wd", "visual_wd", "text_wd", "visual_ld", "text_ld",
                "beta1", "beta2", "eps", "optimizer", "momentum")  # fmt: skip
_RESUME_FLAGS = {"optimizer": "--opt"}  # fields whose flag is not "--" + the name
# Per-tower flags default to the shared one (--visual-lr none = --lr): compare what each resolves to.
_RESUME_DEFAULTS = {"visual_lr": "lr", "text_lr": "lr", "visual_wd": "wd", "text_wd": "wd"}


def check_resume_settings(saved: dict[str, Any], current: dict[str, Any], flag: str) -> None:
    """Raise ResumeSettingsError naming each optimizer flag whose value differs from the checkpoint's run."""

    def resolved(settings: dict[str, Any], name: str) -> Any:
        value = settings.get(name)
        return settings.get(_RESUME_DEFAULTS[name]) if value is None and name in _RESUME_DEFAULTS else value

    changed = [
        f"{_RESUME_FLAGS.get(n, '--' + n.replace('_', '-'))} {resolved(saved, n)} there, {resolved(current, n)} here"
        for n in RESUME_FIXED
        if n in saved and resolved(saved, n) != resolved(current, n)
    ]
    if changed:
        raise ResumeSettingsError(
            f"{flag}: the checkpoint's optimizer state would silently restore its own values of "
            f"{'; '.join(changed)}. Resume with the checkpoint's values, or export it (ds-clip-export) and "
            "start a new run with --pretrained and the new values"
        )


def _deepspeed_safe_globals() -> list:
    # The few non-tensor classes DeepSpeed 0.19.x pickles into its checkpoint files; anything else
    # would need arbitrary unpickling and is refused.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, flag: str = "--resume") -> Any:
    """torch.load with ``weights_only=True`` (tensors, containers and DeepSpeed's own few types).

    A file that needs arbitrary unpickling could run code on load: refuse it with an explanation.
    """
    import pickle

    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{flag}: {path} needs arbitrary unpickling to load (torch.load weights_only=True refused it: "
            f"{first[:200]}); ds_clip only loads tensors and DeepSpeed's own types from files, because "
            "unpickling can run code. Re-save it as a plain state dict or safetensors from a source you trust."
        ) from exc


def install_safe_loading(engine) -> None:
    """Make DeepSpeed's own checkpoint reads go through ``safe_load`` (it passes weights_only=False)."""
    ce = engine.checkpoint_engine
    if ce is not None and not getattr(ce, "_ds_clip_safe", False):
        ce.load = lambda path, map_location=None: safe_load(path)
        ce._ds_clip_safe = True


def _rank() -> int:
    return rank()


def _world() -> int:
    return world_size()


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


# ------------------------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and device) as JSON-able lists."""
    import numpy as np

    version, inner, gauss = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(inner), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ----------------------------------------------------------------------------------------------- save


def param_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Parameter names and shapes as the engine holds them (ZeRO-3's partitioned params: their ds_shape)."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


CHECKSUM = "xxh3_128"
"""The manifest's checksum: xxhash's 128-bit XXH3, ~10x faster than sha256 here (docs/remote.md)."""
_CHUNK = 16 << 20


def file_checksum(path: str | Path) -> str:
    """The CHECKSUM of a file's bytes, read in 16 MiB chunks into one reused buffer."""
    import xxhash

    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _listing(path: Path) -> list[str]:
    return [
        str(f.relative_to(path))
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name not in (MANIFEST, MARKER)
    ]


def _manifest(path: Path, sums: dict[str, list] | None = None) -> dict[str, Any]:
    """{"checksum": CHECKSUM, "files": {name: {"bytes": size, CHECKSUM: hex}}}; ``sums`` holds what the
    writers hashed ({name: [size, hex]}); a file no writer hashed (the small ones) is hashed here. ``sums``
    None: sizes only (the benchmark's baseline)."""
    files: dict[str, dict[str, Any]] = {}
    for name in _listing(path):
        size = (path / name).stat().st_size
        entry: dict[str, Any] = {"bytes": size}
        if sums is not None:
            known = sums.get(name)
            entry[CHECKSUM] = known[1] if known and known[0] == size else file_checksum(path / name)
        files[name] = entry
    return {"checksum": CHECKSUM if sums is not None else None, "files": files}


def manifest_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size[, CHECKSUM: hex]}} of a manifest; older manifests were {name: size}."""
    if isinstance(manifest.get("files"), dict):
        return manifest["files"]
    return {name: {"bytes": size} for name, size in manifest.items()}


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
) -> Path:
    """Every rank calls this. Returns the checkpoint folder; raises SaveError on every rank when any rank
    could not write its part (the partial folder is removed, ``latest_complete`` still names the last
    complete checkpoint).

    ``write_extra(path)``: writes this rank's files of state DeepSpeed does not hold (the weight EMA) into the
    folder before it is listed in the manifest and marked complete; returns them (this rank hashes them).

    ``meta`` (JSON-able, rank 0's is written) should hold epoch, samples_seen, world_size, accum_freq,
    micro_batch_size, model, model_cfg; the engine's ZeRO stage and parameter shapes are added here.
    ``checksums`` False writes sizes only (for measuring what the checksums cost).
    """
    ckpt_root = run_dir / "checkpoints"
    tag = tag_for(step)
    path = ckpt_root / tag
    if _rank() == 0 and (path / MARKER).exists():
        (path / MARKER).unlink()  # rewriting a step (a resumed run): not complete until we say so
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
        "settings": settings,
    }
    faults.maybe_kill("kill-in-save", step, _rank())
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
        prune(ckpt_root, keep)
    _barrier()
    return path


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


def _step_of(folder: Path) -> int | None:
    name = folder.name
    if not name.startswith(TAG_PREFIX) or not name[len(TAG_PREFIX) :].isdigit():
        return None
    return int(name[len(TAG_PREFIX) :])


def prune(ckpt_root: Path, keep: int) -> list[Path]:
    """Delete checkpoints older than the newest ``keep`` complete ones (complete or partial); return them.

    Only called after a newer checkpoint is complete, so at least one complete checkpoint always stays.
    """
    folders = sorted((p for p in ckpt_root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of)
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


# ----------------------------------------------------------------------------------------------- find


def resolve(run_dir: Path | None, resume: str) -> Path:
    """The checkpoint folder named by ``--resume`` ('latest' of run_dir, a checkpoint folder, or a run folder),
    checked complete: marker present, every file of the manifest there with its size."""
    flag = f"--resume {resume}"
    if resume == "latest":
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


def first_mismatch(path: Path, share: tuple[int, int] = (0, 1)) -> tuple[str, str] | None:
    """The first file of ``path``'s manifest (of this share: file i when i mod W == r for share (r, W))
    whose checksum differs from the manifest's, as (name, "xxh3_128 GOT, saved WANT"); None if all match.
    A manifest without checksums (written before they existed) has nothing to check."""
    manifest = json.loads((path / MANIFEST).read_text())
    algorithm = manifest.get("checksum") if isinstance(manifest.get("files"), dict) else None
    if algorithm is None:
        return None
    if algorithm != CHECKSUM:
        return MANIFEST, f"checksum {algorithm!r}, this ds_clip knows {CHECKSUM!r}"
    r, w = share
    for i, (name, entry) in enumerate(sorted(manifest["files"].items())):
        if i % w != r:
            continue
        got = file_checksum(path / name) if (path / name).is_file() else "missing"
        if got != entry[CHECKSUM]:
            return name, f"{CHECKSUM} {got}, saved {entry[CHECKSUM]}"
    return None


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


# ----------------------------------------------------------------------------------------------- load


def check_compatible(
    meta: dict[str, Any], flag: str, *, shapes: dict[str, list[int]], global_batch: int, world_size: int
) -> None:
    """Raise CheckpointError if the checkpoint's model or global batch differ from this run's."""
    saved = meta["param_shapes"]
    if saved != shapes:
        missing = sorted(set(shapes) - set(saved))
        extra = sorted(set(saved) - set(shapes))
        differ = sorted(n for n in set(saved) & set(shapes) if saved[n] != shapes[n])
        detail = (
            f"missing in checkpoint: {missing[:3]}"
            if missing
            else f"not in this model: {extra[:3]}"
            if extra
            else f"{differ[0]} is {saved[differ[0]]} there, {shapes[differ[0]]} here"
        )
        raise CheckpointError(
            f"{flag}: incompatible model: the checkpoint was saved from --model {meta.get('model')!r} ({detail}); "
            "resume with the same --model, or export it (ds-clip-export) and fine-tune with --pretrained"
        )
    saved = BatchGeometry(meta["world_size"], meta["accum_freq"], meta["micro_batch_size"])
    if saved.global_batch != global_batch:
        hint = f": use --global-batch-size {saved.global_batch}"
        try:  # or the --accum-freq that keeps the saved N on this run's ranks with the saved micro-batch
            keep = BatchGeometry.for_global_batch(world_size, saved.micro_batch_size, saved.global_batch)
            hint += f" (or --batch-size {keep.micro_batch_size} --accum-freq {keep.accum_freq})"
        except ValueError:
            pass
        raise CheckpointError(
            f"{flag}: the checkpoint trained global batch N = W*k*m = {saved.world_size}*{saved.accum_freq}*"
            f"{saved.micro_batch_size} = {saved.global_batch}, this run {global_batch}; a resume keeps N{hint} (or "
            "start a new run with --pretrained from an export)"
        )


def load(
    engine,
    run_dir: Path | None,
    resume: str,
    *,
    shapes: dict[str, list[int]] | None = None,
    global_batch: int | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every rank calls this; returns {'step', 'epoch', 'samples_seen', 'data', 'path', 'meta', 'resharded'}.

    ``shapes`` (param_shapes of the model before deepspeed.initialize) and ``global_batch`` are checked
    against the checkpoint first, for a clear error instead of DeepSpeed's size mismatch; ``settings`` (this
    run's, flat) for optimizer flags the load would silently undo (``check_resume_settings``).
    """
    install_safe_loading(engine)
    flag = f"--resume {resume}"
    path = resolve(run_dir, resume)
    meta = read_meta(path)
    world, rank = _world(), _rank()
    if shapes is not None and global_batch is not None:
        check_compatible(meta, flag, shapes=shapes, global_batch=global_batch, world_size=world)
    if settings is not None and meta.get("settings"):
        check_resume_settings(meta["settings"], settings, flag)
    stage = int(engine.zero_optimization_stage())
    same_shape = meta["world_size"] == world and meta["zero_stage"] == stage
    try:
        if same_shape or (meta["zero_stage"] == 0 and stage == 0 and not _has_zero_files(path)):
            # ZeRO-0 fp32 saves the whole optimizer state in one file: any world size loads it.
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
            if load_path is None:
                raise CheckpointError(f"{flag}: DeepSpeed found no checkpoint in {path}")
        else:
            _load_other_shape(engine, path, meta, stage, flag, run_dir)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as exc:
        raise CheckpointError(f"{flag}: cannot load {path}: {type(exc).__name__}: {exc}") from exc
    # This rank's data position and RNG; on another world size, rank 0's position (the data loader counts
    # whole micro-batches from it) and the RNG state of rank r mod W_saved.
    own = path / f"rank{rank}.json"
    src = own if meta["world_size"] == world else path / f"rank{rank % meta['world_size']}.json"
    per_rank = json.loads(src.read_text())
    data_state = (
        per_rank["data"]
        if meta["world_size"] == world
        else json.loads((path / "rank0.json").read_text())["data"]
    )
    set_rng_state(per_rank["rng"])
    return {
        "step": int(meta["step"]),
        "epoch": meta.get("epoch"),
        "samples_seen": meta.get("samples_seen"),
        "data": data_state,
        "path": str(path),
        "meta": meta,
        "resharded": not same_shape,
    }


def _has_zero_files(path: Path) -> bool:
    return any(path.glob("*zero_pp_rank_*_optim_states.pt"))


def _universal_dir(path: Path, run_dir: Path | None, flag: str) -> Path:
    """Convert ``path`` to DeepSpeed's universal layout once (rank 0), next to this run's checkpoints."""
    from argparse import Namespace

    out_root = (run_dir / "checkpoints") if run_dir is not None else path.parent
    out = out_root / f"{UNIVERSAL_PREFIX}{path.parent.parent.name}-{path.name}"
    error = [None]
    if _rank() == 0 and not (out / MARKER).exists():
        try:
            from deepspeed.checkpoint import ds_to_universal

            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            ds_to_universal.main(
                Namespace(
                    input_folder=str(path),
                    output_folder=str(out),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=True,
                )
            )
            (out / MARKER).write_text(path.name)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error[0] = f"{type(exc).__name__}: {exc}"
    error[0] = broadcast_object(error[0], src=0)
    if error[0] is not None:
        raise CheckpointError(
            f"{flag}: converting {path} to DeepSpeed's universal checkpoint failed ({error[0]}); resume on "
            "the world size and ZeRO stage it was saved with, or export it and fine-tune with --pretrained"
        )
    return out


def _load_other_shape(engine, path: Path, meta: dict[str, Any], stage: int, flag: str, run_dir) -> None:
    if meta["zero_stage"] == 0 and not _has_zero_files(path):
        raise CheckpointError(
            f"{flag}: the checkpoint is ZeRO-0 and this run ZeRO-{stage}: resume with --zero-stage 0 (any world "
            "size), or export it and fine-tune with --pretrained"
        )
    if stage == 0:
        raise CheckpointError(
            f"{flag}: the checkpoint is ZeRO-{meta['zero_stage']} on {meta['world_size']} ranks; a different "
            "world size needs ZeRO-1, 2 or 3 here (--zero-stage)"
        )
    universal = _universal_dir(path, run_dir, flag)
    try:
        if stage in (1, 2):
            # DeepSpeed's own universal load is exact for ZeRO-1/2 (tested); the engine reads this switch at load.
            config = engine._config
            saved, config.load_universal_checkpoint = config.load_universal_checkpoint, True
            try:
                load_path, _ = engine.load_checkpoint(str(universal.parent), tag=universal.name)
            finally:
                config.load_universal_checkpoint = saved
            if load_path is None:
                raise CheckpointError(f"{flag}: DeepSpeed found no checkpoint in {universal}")
        else:
            _load_resharded(engine, universal / "zero")
            _load_common(engine, path)
    finally:
        # The converted copy (full fp32 weights and moments) is only a means of loading: drop it once all
        # ranks have read it; the next save of this run is a normal checkpoint on the new world size.
        _barrier()
        if _rank() == 0:
            shutil.rmtree(universal, ignore_errors=True)


def _load_common(engine, path: Path) -> None:
    """What is not per parameter: LR scheduler, engine counters, module buffers (BatchNorm statistics)."""
    files = sorted(path.glob("*mp_rank_00_model_states.pt"))
    state = safe_load(files[0])
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        sched = engine.lr_scheduler
        sched.load_state_dict(state["lr_scheduler"])
        # A scheduler writes the learning rate into the optimizer only when it steps: do it for the saved one.
        for group, lr in zip(engine.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr
    engine.global_steps = state.get("global_steps", engine.global_steps)
    engine.global_samples = state.get("global_samples", engine.global_samples)
    module_state = state.get("module") or {}
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            if name in module_state:
                buf.copy_(module_state[name].to(buf.dtype).view_as(buf))


def _load_resharded(engine, zero_dir: Path) -> None:
    """ZeRO-3: write full per-parameter fp32 weights and Adam moments (DeepSpeed's universal layout,
    zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt) into this rank's partitions and working shards."""
    opt = engine.optimizer
    if not hasattr(opt, "_get_fp32_opt_state_partition"):
        raise CheckpointError(f"resharding into a {type(opt).__name__} optimizer is not supported")
    # Adam creates its state at the first step; a resumed engine has not stepped yet: create it empty.
    for flat in opt.fp32_partitioned_groups_flat:
        state = opt.optimizer.state[flat]
        if not state:
            state.update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat)
            )
    step_value = None
    for name, p in engine.module.named_parameters():
        folder = zero_dir / name
        if not (folder / "fp32.pt").exists():
            raise CheckpointError(f"universal checkpoint {zero_dir} has no state for parameter {name}")
        rank = opt._get_param_partition_rank(p)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            f = folder / f"{key}.pt"
            if not f.exists():
                continue
            t = safe_load(f)
            value = (t["param"] if isinstance(t, dict) else t).float().flatten()
            # This rank holds elements [rank*part, (rank+1)*part) of the zero-padded flat parameter.
            part, _ = opt._get_fp32_opt_state_partition(
                p, release_swap_buffers=False, optim_state_key=None if key == "fp32" else key
            )
            _copy_slice(part.data, value, rank)
            if key == "fp32":
                _copy_slice(p.ds_tensor.data, value, rank)
        if step_value is None and (folder / "step.pt").exists():
            s = safe_load(folder / "step.pt")
            step_value = s["param"] if isinstance(s, dict) else s
    if step_value is None and (zero_dir / "optimizer_state.pt").exists():  # ZeRO-3 sources keep it here
        common = safe_load(zero_dir / "optimizer_state.pt")
        states = common.get("optimizer_state_dict", {}).get("state", {})
        step_value = next((st["step"] for st in states.values() if "step" in st), None)
    if step_value is None:
        raise CheckpointError(f"universal checkpoint {zero_dir} records no optimizer step count")
    # Adam's step count (bias correction) is kept per flat partition; the same for every parameter.
    if step_value is not None:
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = (
                    step_value.clone() if torch.is_tensor(st["step"]) else type(st["step"])(step_value)
                )


def _copy_slice(dst: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    n = dst.numel()
    start = n * rank
    take = max(0, min(n, full.numel() - start))
    flat = dst.view(-1)
    flat.zero_()
    if take:
        flat[:take].copy_(full[start : start + take].to(flat.dtype))


# ----------------------------------------------------------------------------------------- the cadence


def epochs_done_at(step: int, steps_per_epoch: int | None) -> int | None:
    """The number of epochs completed when optimizer step ``step`` ends one, else None (epoch cadences)."""
    if not steps_per_epoch or step <= 0 or step % steps_per_epoch:
        return None
    return step // steps_per_epoch


def on_cadence(
    step: int, every_n_steps: int | None, epochs_done: int | None, every_n_epochs: int | None
) -> bool:
    """A step cadence and an epoch cadence combine: the step is on either one (0 or None: off)."""
    on_steps = bool(every_n_steps) and step % every_n_steps == 0
    return on_steps or (
        epochs_done is not None and bool(every_n_epochs) and epochs_done % every_n_epochs == 0
    )


class CheckpointPart(Protocol):
    """State beside DeepSpeed's that a checkpoint carries (the weight EMA): written by every rank into the
    checkpoint folder, read back on resume."""

    def save_to(self, path: Path) -> list[Path]: ...

    def load_from(self, path: Path, *, is_main: bool) -> bool: ...


class Checkpointer:
    """When the trainer saves, and what a save records: owns ``--save-every-n-steps``, ``--save-frequency``
    (epochs), ``--save-most-recent``, ``--keep-checkpoints`` (``--delete-previous-checkpoint``: 1) and
    ``--resume``. Every rank holds one and calls every method (saves and loads are collectives)."""

    def __init__(
        self,
        engine,
        run_dir: Path,
        data,
        section: CheckpointSettings,
        *,
        geometry: BatchGeometry,
        settings: dict[str, Any],
        meta: dict[str, Any],
        steps_per_epoch: int | None = None,
        parts: Sequence[CheckpointPart] = (),
    ) -> None:
        """``section``: the checkpoint flags; ``geometry``: the run's W, k, m (the N a resume must keep, the
        samples a step counts); ``settings``: the flat settings (settings.json) a resume checks; ``meta``: what
        else each checkpoint records (model, precision, ...)."""
        self.engine, self.run_dir, self.data = engine, Path(run_dir), data
        self.settings, self.geometry = settings, geometry
        # N is recorded as such: a resume on another world size re-derives k from it (--global-batch-size).
        self.meta = {
            "accum_freq": geometry.accum_freq,
            "micro_batch_size": geometry.micro_batch_size,
            "global_batch_size": geometry.global_batch,
            **meta,
        }
        self.every_n_steps, self.every_n_epochs = section.save_every_n_steps, section.save_frequency
        self.keep = 1 if section.delete_previous_checkpoint else section.keep_checkpoints
        self.most_recent, self.steps_per_epoch = section.save_most_recent, steps_per_epoch
        self.on_failure = section.on_save_failure
        self.parts = list(parts)
        self.resumed_from: Path | None = None
        """The checkpoint folder ``resume`` loaded (None: a fresh start)."""
        self._recent_only: Path | None = None
        """The last checkpoint saved only for --save-most-recent: deleted once a newer one is complete."""

    def save(self, step: int, *, recent_only: bool = False) -> Path:
        """Save now (every rank). A failed save raises SaveError naming the checkpoint, the path and why."""
        meta = {**self.meta, "epoch": self.data.epoch, "samples_seen": step * self.geometry.global_batch}
        try:
            path = save(
                self.engine,
                self.run_dir,
                step,
                self.data.state_dict(),
                self.settings,
                meta=meta,
                keep=self.keep,
                write_extra=self._write_parts if self.parts else None,
            )
        except SaveError as exc:
            raise SaveError(
                f"{exc}. Free space (or fix the permission) and relaunch with --resume latest; "
                "--on-save-failure continue keeps training and tries again at the next save"
            ) from None
        previous, self._recent_only = self._recent_only, (path if recent_only else None)
        if previous is not None and previous != path and _rank() == 0 and previous.exists():
            # The marker goes first (as in prune): a deletion cut short leaves a folder that reads as partial.
            (previous / MARKER).unlink(missing_ok=True)
            shutil.rmtree(previous, ignore_errors=True)
            logger.info(
                "removed %s: --save-most-recent keeps the newest epoch's checkpoint only", previous.name
            )
        return path

    def _write_parts(self, path: Path) -> list[Path]:
        return [f for part in self.parts for f in part.save_to(path)]

    def maybe_save(self, step: int, total_steps: int) -> None:
        """Save on the step or epoch cadence, or at an epoch's end for --save-most-recent; the last step is
        saved by ``save`` at the end of the run, once."""
        if step >= total_steps:
            return
        epochs = epochs_done_at(step, self.steps_per_epoch)
        try:
            if on_cadence(step, self.every_n_steps, epochs, self.every_n_epochs):
                self.save(step)
            elif epochs is not None and self.most_recent:
                self.save(step, recent_only=True)
        except SaveError as exc:
            if self.on_failure != "continue":
                raise
            if _rank() == 0:
                logger.warning(
                    "%s; training goes on (--on-save-failure continue): the next save tries again",
                    str(exc).split(". Free space", 1)[0],
                )

    def resume(self, resume: str, *, shapes: dict[str, list[int]], is_main: bool) -> int:
        """Load ``--resume`` into the engine and the data position; returns the step to continue from.

        ``--resume latest`` before the run has a complete checkpoint starts from step 0 and says so in one line
        (open_clip's behaviour): the same command then serves the first start and every restart (an elastic
        agent's, a re-queued job's). A pointer to a checkpoint that is missing or partial stays an error."""
        root = self.run_dir / "checkpoints"
        if is_main:
            for p in remove_partial(root):
                logger.warning("removed partial checkpoint %s (a save that was cut short)", p)
        # Rank 0's view decides for every rank (a collective): all start fresh or all load.
        fresh = broadcast_object(resume == "latest" and not (root / POINTER).exists())
        if fresh:
            if is_main:
                logger.info("--resume latest: no complete checkpoint in %s yet; starting from scratch", root)
            return 0
        state = load(
            self.engine,
            self.run_dir,
            resume,
            shapes=shapes,
            global_batch=self.geometry.global_batch,
            settings=self.settings,
        )
        self.data.load_state_dict(state["data"])
        self.resumed_from = Path(state["path"])
        for part in self.parts:
            part.load_from(self.resumed_from, is_main=is_main)
        if is_main:
            logger.info(
                "resumed from %s at step %d (epoch %d, step %d in epoch)%s",
                state["path"],
                state["step"],
                self.data.epoch,
                self.data.step_in_epoch,
                " on a new world size / ZeRO stage" if state["resharded"] else "",
            )
        return int(state["step"])
