"""Checkpoints on remote storage (``--remote-sync URL``): the run folder copied to URL/<name>, and pulled back.

    ds-clip-train ... --save-every-n-steps 500 --remote-sync s3://bucket/runs            (s3fs)
    ds-clip-train ... --remote-sync gs://bucket/runs --remote-sync-protocol fsspec        (gcsfs)
    ds-clip-train ... --remote-sync s3://bucket/runs --resume latest   # a fresh node: pulls, checks, resumes

The layout is open_clip's: URL/<name>/ mirrors <logs>/<name>/ (settings, metrics, TensorBoard, checkpoints).
Rank 0 runs ``RemoteSync`` in a background thread, every ``--remote-sync-frequency`` seconds and once at the
end, so the training step never waits for the network. What reaches the remote:

- only complete checkpoints (a local ``COMPLETE`` marker), each file streamed through the checksum and
  compared with the manifest on the way (a file that changed after its save is not uploaded), the manifest
  next, the ``COMPLETE`` marker last, then the remote ``latest_complete`` pointer: a sync cut short leaves a
  folder without the marker, which nothing pulls;
- a step already complete on the remote whose local manifest differs (a run resumed from an older checkpoint
  saved it again: another history) goes up again the same way, its remote folder removed first (marker first);
- the remote ``latest_complete`` names what the local one does (the newest checkpoint of the local history on
  the remote), never a higher step of a history the run left;
- the other files of the run folder whenever their size or modification time changed;
- with ``--keep-checkpoints N``, the remote keeps the newest N complete checkpoints too (marker deleted first).

A failed sync is logged with its reason and tried again at the next period; training goes on. An unreachable
or unwritable remote is refused at start (``check_writable``, exit 2). ``pull_latest`` (``--resume latest``)
downloads the checkpoint the remote ``latest_complete`` names when it is newer than the local one, checks
every file against the manifest's sizes and checksums in a hidden folder, and only then makes it a local
complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_clip.checkpoint import CHECKSUM, MANIFEST, MARKER, POINTER, TAG_PREFIX
from ds_clip.checkpoint.manifest import first_mismatch, manifest_files
from ds_clip.config import CheckpointSettings
from ds_clip.distributed import broadcast_object, rank
from ds_clip.errors import RunError, UserError

logger = logging.getLogger("ds_clip")

_CHUNK = 16 << 20


class RemoteError(UserError):
    """The remote cannot be used: unreachable or unwritable at start, or a pulled checkpoint that fails its
    checksums."""


class RemoteIncompleteError(RunError):
    """The run finished but its last sync to --remote-sync did not (timed out or failed): the remote lacks what
    the message lists; the local run folder is complete. Exit status 1."""


class SyncError(Exception):
    """One sync that did not finish (logged, tried again at the next period)."""


@dataclass(frozen=True)
class Remote:
    """URL/<name> on an fsspec file system: ``fs`` and the run's folder ``root`` on it (no protocol)."""

    fs: Any
    root: str
    url: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])


def open_remote(url: str, name: str) -> Remote:
    """The run folder ``url``/``name`` on its file system (s3fs for s3://, any fsspec implementation)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if "file" in _protocols(fs):
        # A local or mounted folder: let open() create parent folders, as object stores need none.
        fs, root = fsspec.core.url_to_fs(url, auto_mkdir=True)
    return Remote(fs=fs, root=f"{root.rstrip('/')}/{name}", url=f"{url.rstrip('/')}/{name}")


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def check_writable(remote: Remote, flag: str = "--remote-sync") -> None:
    """Write, read back and delete a small file under the run's remote folder; one line if that fails."""
    probe = remote.path(f".ds_clip_write_test.{os.getpid()}")
    try:
        with remote.fs.open(probe, "wb") as f:
            f.write(b"ok")
        with remote.fs.open(probe, "rb") as f:
            ok = f.read() == b"ok"
        remote.fs.rm(probe)
    except Exception as exc:  # noqa: BLE001 - s3fs, gcsfs, aiohttp... each raise their own kinds
        raise RemoteError(
            f"{flag} {remote.url}: cannot write there ({_first_line(exc)}); check the URL, the credentials "
            "(AWS_* / AWS_ENDPOINT_URL for s3) and that the bucket exists"
        ) from None
    if not ok:
        raise RemoteError(f"{flag} {remote.url}: a file written there reads back different")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _step_of(name: str) -> int | None:
    rest = name[len(TAG_PREFIX) :] if name.startswith(TAG_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def _local_complete(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and _step_of(p.name) is not None]
    return sorted((p for p in found if (p / MARKER).exists()), key=lambda p: _step_of(p.name))


def remote_complete(remote: Remote) -> list[str]:
    """Tags of the remote's complete checkpoints (with their COMPLETE marker), oldest first."""
    root = remote.path("checkpoints")
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in remote.fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    tags = sorted((n for n in names if _step_of(n) is not None), key=_step_of)
    return [t for t in tags if remote.fs.exists(remote.path("checkpoints", t, MARKER))]


def _copy_hashed(src, dst) -> str:
    """Copy one open file to another in chunks, returning the CHECKSUM of the bytes that went through."""
    import xxhash

    h = xxhash.xxh3_128()
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        dst.write(chunk)
    return h.hexdigest()


class RemoteSync:
    """Rank 0's copier of the run folder to the remote: ``start`` a background thread, ``close`` at the end."""

    def __init__(self, remote: Remote, run_dir: Path, *, every_s: float, keep: int | None) -> None:
        self.remote, self.run_dir, self.every_s, self.keep = remote, Path(run_dir), every_s, keep
        self._sent: dict[str, tuple[int, int]] = {}
        """Run-folder files uploaded, with the (size, mtime_ns) they had then."""
        self._complete: set[str] | None = None
        """Checkpoint tags complete on the remote (listed once, then kept up to date)."""
        self._manifests: dict[str, bytes | None] = {}
        """The manifest each complete remote checkpoint holds (read once, then what was uploaded): a local
        checkpoint of the same step with another manifest (a run resumed from an older step rewrote it) goes up
        again."""
        self._pointer: str | None = None
        """The tag last written to the remote ``latest_complete`` by this process."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def start(self) -> RemoteSync:
        self._thread = threading.Thread(target=self._loop, name="ds_clip-remote-sync", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync_once()

    def close(self, timeout_s: float = 600.0) -> str | None:
        """Stop the thread (after the sync it is in) and sync once more, so the last checkpoint goes up too,
        waiting ``timeout_s`` seconds at most in all (--remote-sync-final-timeout): a store that stopped
        answering must not keep a finished job, and its allocation, alive. Returns None when everything went up,
        else one line saying what is and is not complete on the remote (the local run folder is untouched; a
        copy still under way is left to its daemon thread, which ends with the process)."""
        self._stop.set()
        outcome: list[bool] = []

        def last_sync() -> None:
            if self._thread is not None:
                self._thread.join()
            outcome.append(self.sync_once())

        final = threading.Thread(target=last_sync, name="ds_clip-remote-final-sync", daemon=True)
        final.start()
        final.join(timeout_s)
        if outcome == [True]:
            return None
        why = (
            "the last sync failed (logged above)"
            if outcome
            else f"the last sync did not finish within --remote-sync-final-timeout {timeout_s:g} s"
        )
        return f"remote sync to {self.remote.url}: {why}; {self.describe_remote()}"

    def describe_remote(self) -> str:
        """Which local complete checkpoints are complete on the remote, which are not, and where the local copy
        is (rank 0's view after its syncs; nothing is listed again)."""
        local = _local_complete(self.run_dir / "checkpoints")
        there = set(self._complete or ())
        up = [p.name for p in local if p.name in there and self._same_there(p)]
        missing = [p.name for p in local if p.name not in up]
        return (
            f"complete on the remote: {', '.join(up) or 'no checkpoint'}; not on the remote: "
            f"{', '.join(missing) or 'no checkpoint'} (and possibly the newest logs); the local run folder "
            f"{self.run_dir} is complete and kept"
        )

    def _same_there(self, folder: Path) -> bool:
        """The remote copy of ``folder`` holds its manifest (as uploaded or read by this process)."""
        try:
            return self._manifests.get(folder.name) == (folder / MANIFEST).read_bytes()
        except FileNotFoundError:
            return False

    def sync_once(self) -> bool:
        """One pass; a failure is logged (never raised) and the next pass tries again. True if it all went up."""
        try:
            self._sync_files()
            self._sync_checkpoints()
        except Exception as exc:  # noqa: BLE001 - a sync failure must never end training
            self.failures += 1
            logger.warning(
                "remote sync to %s failed (%s); retrying in %g s, training goes on",
                self.remote.url, _first_line(exc), self.every_s,
            )  # fmt: skip
            return False
        return True

    # -- the run folder's other files

    def _sync_files(self) -> None:
        for f in sorted(self.run_dir.rglob("*")):
            rel = f.relative_to(self.run_dir)
            if rel.parts[0] == "checkpoints" or not f.is_file():
                continue
            try:
                st = f.stat()
            except FileNotFoundError:  # removed while we walked (a temporary file)
                continue
            key = str(rel)
            if self._sent.get(key) == (st.st_size, st.st_mtime_ns):
                continue
            with f.open("rb") as src, self.remote.fs.open(self.remote.path(*rel.parts), "wb") as dst:
                _copy_hashed(src, dst)
            self._sent[key] = (st.st_size, st.st_mtime_ns)

    # -- checkpoints

    def _sync_checkpoints(self) -> None:
        if self._complete is None:
            self._complete = set(remote_complete(self.remote))
        ckpt_root = self.run_dir / "checkpoints"
        synced = []  # local complete checkpoints whose remote copy is now the same (same manifest)
        for folder in _local_complete(ckpt_root):
            try:
                manifest = (folder / MANIFEST).read_bytes()
                if folder.name in self._complete and self._remote_manifest(folder.name) == manifest:
                    synced.append(folder.name)
                    continue
                # Not there, or there from another history (a run resumed from an older step that saved this
                # step again): the remote copy becomes the local one, its marker removed first, written last.
                self._complete.discard(folder.name)  # until its marker is up again
                self._upload(folder, manifest)
            except FileNotFoundError:
                # Pruned locally (--keep-checkpoints) while it went up: drop the remote partial copy.
                self._remove_remote(folder.name)
                self._complete.discard(folder.name)
                continue
            self._complete.add(folder.name)
            self._manifests[folder.name] = manifest
            synced.append(folder.name)
            logger.info("remote sync: %s is complete on %s", folder.name, self.remote.url)
        newest = self._point(ckpt_root, synced)
        if self.keep is not None:
            # As the local prune: steps after the local pointer's are a history the run left, neither kept nor
            # removed by count (by step number alone, the run's own new checkpoints would go first).
            ours = [t for t in self._complete if newest is None or _step_of(t) <= newest]
            for tag in sorted(ours, key=_step_of)[: -self.keep]:
                self._remove_remote(tag)
                self._complete.discard(tag)
                self._manifests.pop(tag, None)

    def _remote_manifest(self, tag: str) -> bytes | None:
        if tag not in self._manifests:
            try:
                with self.remote.fs.open(self.remote.path("checkpoints", tag, MANIFEST), "rb") as f:
                    self._manifests[tag] = f.read()
            except FileNotFoundError:
                self._manifests[tag] = None
        return self._manifests[tag]

    def _point(self, ckpt_root: Path, synced: list[str]) -> int | None:
        """The remote ``latest_complete``: the newest checkpoint of the local history (at or before the local
        pointer) whose remote copy is the local one. Never a newer step of a history the run left: a fresh node
        pulls what this node would resume from. Returns the local pointer's step (None without one)."""
        pointer = ckpt_root / POINTER
        try:
            local = _step_of(pointer.read_text().strip())
        except FileNotFoundError:
            local = None
        candidates = [t for t in synced if local is None or _step_of(t) <= local]
        if not candidates:
            return local
        tag = max(candidates, key=_step_of)
        if tag != self._pointer:
            with self.remote.fs.open(self.remote.path("checkpoints", POINTER), "wb") as f:
                f.write(tag.encode())
            self._pointer = tag
        return local

    def _upload(self, folder: Path, manifest_bytes: bytes) -> None:
        """The manifest's files (each checked against its checksum on the way), the manifest, the marker last.
        A remote folder of the same tag is removed first (marker first): its files may be another history's."""
        manifest = json.loads(manifest_bytes)
        fs, rdir = self.remote.fs, self.remote.path("checkpoints", folder.name)
        if fs.exists(rdir):
            self._remove_remote(folder.name)
        self._manifests.pop(folder.name, None)
        for name, entry in manifest_files(manifest).items():
            with (folder / name).open("rb") as src, fs.open(f"{rdir}/{name}", "wb") as dst:
                digest = _copy_hashed(src, dst)
            if CHECKSUM in entry and digest != entry[CHECKSUM]:
                raise SyncError(
                    f"{folder / name} no longer matches the checksum saved in its manifest (changed on disk "
                    f"after the save): {folder.name} is not uploaded"
                )
        with fs.open(f"{rdir}/{MANIFEST}", "wb") as dst:
            dst.write(manifest_bytes)
        with (folder / MARKER).open("rb") as src, fs.open(f"{rdir}/{MARKER}", "wb") as dst:
            _copy_hashed(src, dst)  # the marker last: a remote folder without it is never pulled

    def _remove_remote(self, tag: str) -> None:
        fs, rdir = self.remote.fs, self.remote.path("checkpoints", tag)
        try:
            if fs.exists(f"{rdir}/{MARKER}"):
                fs.rm(f"{rdir}/{MARKER}")  # first: a deletion cut short leaves a folder that reads as partial
            fs.rm(rdir, recursive=True)
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------- pulling


def pull_latest(remote: Remote, run_dir: Path, flag: str = "--resume latest") -> Path | None:
    """Rank 0: when the checkpoint the remote ``latest_complete`` names (else its newest complete one) is newer
    than the local one (``latest_complete``, else the newest complete), download it into a hidden folder,
    check every file against the manifest (sizes and checksums), then make it the local ``latest_complete``. Also fetches the run folder's other files that are not here (metrics, TensorBoard).
    Returns the pulled folder, or None when the local checkpoint is as new. Raises RemoteError."""
    ckpt_root = run_dir / "checkpoints"
    try:
        tags = remote_complete(remote)
    except Exception as exc:  # noqa: BLE001
        raise RemoteError(f"{flag}: cannot list {remote.url}/checkpoints ({_first_line(exc)})") from None
    tag = _remote_latest(remote, tags)
    local = _local_latest(ckpt_root)
    if tag is None or (local is not None and _step_of(local) >= _step_of(tag)):
        return None
    _pull_run_files(remote, run_dir)
    tmp, final = ckpt_root / f".pull-{tag}", ckpt_root / tag
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fs, rdir = remote.fs, remote.path("checkpoints", tag)
    try:
        with fs.open(f"{rdir}/{MANIFEST}", "rb") as f:
            manifest = json.loads(f.read())
        for name in [*manifest_files(manifest), MANIFEST]:
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            with fs.open(f"{rdir}/{name}", "rb") as src, (tmp / name).open("wb") as dst:
                _copy_hashed(src, dst)
    except Exception as exc:  # noqa: BLE001
        shutil.rmtree(tmp, ignore_errors=True)
        raise RemoteError(
            f"{flag}: pulling {remote.url}/checkpoints/{tag} failed ({_first_line(exc)})"
        ) from None
    for name, entry in manifest_files(manifest).items():
        if (tmp / name).stat().st_size != entry["bytes"]:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RemoteError(
                f"{flag}: {remote.url}/checkpoints/{tag}/{name} has {(tmp / name).stat().st_size} bytes, its "
                f"manifest says {entry['bytes']}: the remote copy is damaged"
            )
    bad = first_mismatch(tmp)
    if bad is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        older = [t for t in tags if _step_of(t) < _step_of(tag)]
        raise RemoteError(
            f"{flag}: {remote.url}/checkpoints/{tag}/{bad[0]} does not match its checksum in {MANIFEST} "
            f"({bad[1]}): the remote copy is damaged; "
            + (
                f"older complete remote checkpoints: {', '.join(older[-3:])} (pull one with your tool and "
                "resume with --resume DIR)"
                if older
                else "no older complete checkpoint on the remote"
            )
        )
    (tmp / MARKER).write_text(str(_step_of(tag)))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer_tmp = ckpt_root / f".{POINTER}.tmp"
    pointer_tmp.write_text(tag)
    os.replace(pointer_tmp, ckpt_root / POINTER)
    return final


def _remote_latest(remote: Remote, tags: list[str]) -> str | None:
    """The remote ``latest_complete`` when it names a complete remote checkpoint, else the newest complete one.
    The pointer, not the highest step: after a resume from an older step, higher steps of the abandoned
    history may still be complete there."""
    try:
        with remote.fs.open(remote.path("checkpoints", POINTER), "rb") as f:
            named = f.read().decode().strip()
    except FileNotFoundError:
        named = None
    if named in tags:
        return named
    return tags[-1] if tags else None


def _local_latest(ckpt_root: Path) -> str | None:
    """What ``--resume latest`` continues from here: ``latest_complete``, else the newest complete step."""
    pointer = ckpt_root / POINTER
    if pointer.exists():
        named = pointer.read_text().strip()
        if (ckpt_root / named / MARKER).exists():
            return named
    local = _local_complete(ckpt_root)
    return local[-1].name if local else None


def _pull_run_files(remote: Remote, run_dir: Path) -> None:
    """The remote run folder's files outside checkpoints/ that this run folder lacks (never overwritten)."""
    fs = remote.fs
    try:
        found = fs.find(remote.root)
    except FileNotFoundError:
        return
    prefix = remote.root.rstrip("/") + "/"
    for rpath in found:
        rel = rpath[len(prefix) :] if rpath.startswith(prefix) else None
        if not rel or rel.startswith("checkpoints/") or rel.startswith(".ds_clip_write_test"):
            continue
        local = run_dir / rel
        if local.exists():
            continue
        local.parent.mkdir(parents=True, exist_ok=True)
        with fs.open(rpath, "rb") as src, local.open("wb") as dst:
            _copy_hashed(src, dst)


# ------------------------------------------------------------------------------------------- the run


def start_sync(section: CheckpointSettings, run_dir: Path) -> RemoteSync | None:
    """Every rank calls this at start, before the engine is built. With ``--remote-sync``: rank 0 checks the
    remote is writable, pulls its newest complete checkpoint for ``--resume latest`` when it is newer than
    the local one, and starts the background sync; any failure is one RemoteError on every rank (exit 2).
    Returns rank 0's RemoteSync (None on the other ranks and without --remote-sync)."""
    if section.remote_sync is None:
        return None
    error, remote = None, None
    if rank() == 0:
        try:
            remote = open_remote(section.remote_sync, run_dir.name)
            check_writable(remote)
            if section.resume == "latest":
                pulled = pull_latest(remote, run_dir)
                if pulled is not None:
                    logger.info("pulled %s from %s (sizes and checksums checked)", pulled.name, remote.url)
        except RemoteError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a file system's own error at open: still one line
            error = f"--remote-sync {section.remote_sync}: {_first_line(exc)}"
    error = broadcast_object(error, src=0)
    if error is not None:
        raise RemoteError(error)
    if remote is None:
        return None
    keep = 1 if section.delete_previous_checkpoint else section.keep_checkpoints
    logger.info(
        "remote sync: %s every %d s (background thread; complete checkpoints only)",
        remote.url, section.remote_sync_frequency,
    )  # fmt: skip
    return RemoteSync(remote, run_dir, every_s=section.remote_sync_frequency, keep=keep).start()
