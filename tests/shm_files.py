"""DeepSpeed's CPU shm buffers in /dev/shm, for tests that prove runs leave none (ds_clip/shm.py)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ds_clip import shm


def left_by(port: int | str) -> list[str]:
    """The buffers of the run whose rendezvous port was ``port`` still in /dev/shm (any rank, any addr)."""
    tail = f"_{port}_"
    if not shm.SHM_DIR.is_dir():
        return []
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.BUFFER_PREFIX) and tail in n)


@dataclass
class Planted:
    stale: Path
    """Created and mapped by a process that has exited: no live process maps it."""
    live: Path
    """Mapped by this (test) process for as long as the context lasts."""


def _old(path: Path) -> None:
    # Older than the sweep's grace period (a file a starting rank has not mapped yet is young).
    t = path.stat().st_mtime - 10 * shm.GRACE_S
    os.utime(path, (t, t))


@contextlib.contextmanager
def stale_and_live(port_stale: int, port_live: int) -> Iterator[Planted]:
    """Plant a stale buffer (its owner process is dead) and a live one (mapped here) in /dev/shm."""
    stale = shm.SHM_DIR / shm.buffer_name(0, addr="127.0.0.1", port=str(port_stale))
    live = shm.SHM_DIR / shm.buffer_name(0, addr="127.0.0.1", port=str(port_live))
    # The stale one's owner: a process that creates and maps the file, then ends without unlinking it
    # (as a SIGKILLed rank does).
    code = (
        "import mmap, sys; f = open(sys.argv[1], 'wb+'); f.truncate(4096); "
        "m = mmap.mmap(f.fileno(), 4096); m[:4] = b'rank'"
    )
    subprocess.run([sys.executable, "-c", code, str(stale)], check=True, timeout=60)
    _old(stale)
    with live.open("wb+") as f:
        f.truncate(4096)
        mapping = mmap.mmap(f.fileno(), 4096)
    _old(live)
    try:
        yield Planted(stale, live)
    finally:
        mapping.close()
        for p in (stale, live):
            p.unlink(missing_ok=True)


# Runs in the namespace: plants the two buffers, runs the command beside them, reports what it left.
_BESIDE = """
import json, subprocess, sys
from tests import shm_files
cmd, run_port, stale, live = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with shm_files.stale_and_live(stale, live) as planted:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seen = {"stale": planted.stale.exists(), "live": planted.live.exists(), "left": shm_files.left_by(run_port)}
sys.stdout.write(proc.stdout)
sys.stderr.write(proc.stderr)
print("SHM " + json.dumps(seen))
sys.exit(proc.returncode)
"""


def run_beside_planted(cmd: list[str], run_port: int, port_stale: int, port_live: int) -> list[str]:
    """The command that runs ``cmd`` (a launch whose rendezvous port is ``run_port``) while a stale and a live
    buffer lie in /dev/shm (``stale_and_live``), and reports on its last line ("SHM {json}") whether each is
    still there afterwards and which buffers of the run are left. As root it runs in a /dev/shm of its own (a
    mount namespace with a fresh tmpfs, as in a container): the start of another run on this machine (the
    suite's other worker) sweeps every stale buffer it sees and would take the planted one first."""
    inner = [sys.executable, "-c", _BESIDE, json.dumps(cmd), str(run_port), str(port_stale), str(port_live)]
    if os.geteuid() == 0 and shutil.which("unshare"):
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"', *inner]  # fmt: skip
    return inner


def beside_planted_report(stdout: str) -> dict:
    """The "SHM {json}" line of ``run_beside_planted``'s command."""
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("SHM ")]
    return json.loads(line[len("SHM ") :])
