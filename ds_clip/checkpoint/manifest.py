"""The manifest of a checkpoint folder: every file with its size and checksum (xxh3-128, hashed by the rank
that wrote the file), and the first file that does not match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ds_clip.checkpoint.layout import (
    MANIFEST,
    MARKER,
)

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
