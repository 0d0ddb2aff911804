"""DeepSpeed's CPU shared-memory buffers in /dev/shm: none left behind by a run.

On the CPU accelerator, when every rank runs on one host (the deepspeed launcher sets ``LOCAL_SIZE``),
DeepSpeed 0.19.8's shm comm op (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``) has each
rank create one POSIX shared-memory file of about 70 MB,

    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>

and then map every other rank's file (it polls ``shm_open`` until the file exists). Nothing ever unlinks
them (``shared_close`` has no caller): a run, failed or not, leaves W such files, each holding its memory
until removed. The name encodes the user, the rendezvous and the rank, but no process id, so the owner of
a file is whichever process maps it (or holds it open): a file no live process maps belongs to a run
that is gone.

What ds_clip does (``ds_clip.distributed.init_distributed`` calls the three functions):

* ``sweep_stale`` before the process group starts (local rank 0 only): removes this user's
  ``deepspeed_*`` files that no process maps or holds open and that are older than a few seconds (a
  rank starting right now creates its file and maps it within microseconds), and prints one line with
  the count. This cleans up after ranks that were SIGKILLed before ``release_own`` ran.
* ``release_own`` once every rank has mapped every rank's buffer (after a barrier that follows the
  process group's start): each rank unlinks its own file. The mappings stay valid (the memory is freed
  when the last rank exits, however it exits), so nothing is left in /dev/shm for the rest of the run.
* ``unlink_own_at_exit``: an ``atexit`` fallback for a run that ends between creating its buffer and
  the barrier (a normal exit or an exception; a SIGKILLed rank leaves its file to the next sweep).
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_"
BUFFER_PREFIX = "deepspeed_allreduce_buffer"
"""shm.cpp's SHM_BUFFER_NAME."""
GRACE_S = 10.0
"""A file younger than this is never swept: its creator may not have mapped it yet."""


def buffer_name(rank: int, addr: str | None = None, port: str | None = None, uid: int | None = None) -> str:
    """The name shm.cpp gives rank ``rank``'s buffer (MASTER_ADDR / MASTER_PORT from the environment)."""
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    uid = os.getuid() if uid is None else uid
    return f"{BUFFER_PREFIX}_{uid}_{addr}_{port}_{rank}"


def _in_use(shm_dir: Path) -> set[str]:
    """Names of files in ``shm_dir`` that a live process maps or holds open (processes we may inspect)."""
    used: set[str] = set()
    prefix = str(shm_dir).rstrip("/") + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        used.add(line[i + len(prefix) :].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours to read
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix) :])
        except OSError:
            pass
    return used


def stale_buffers(shm_dir: Path = SHM_DIR, grace_s: float = GRACE_S) -> list[Path]:
    """This user's DeepSpeed files in ``shm_dir`` that no live process maps or holds open."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError:  # no /dev/shm (not Linux)
        return []
    if not names:
        return []
    uid, now = os.getuid(), time.time()
    candidates = []
    for n in names:
        try:
            st = (shm_dir / n).stat()
        except OSError:
            continue
        # Another user's processes cannot be inspected: their files are theirs to clean.
        if st.st_uid == uid and now - st.st_mtime >= grace_s:
            candidates.append(n)
    if not candidates:
        return []
    used = _in_use(shm_dir)
    return [shm_dir / n for n in sorted(candidates) if n not in used]


def sweep_stale(shm_dir: Path = SHM_DIR, grace_s: float = GRACE_S) -> int:
    """Remove this user's DeepSpeed shm files whose processes are gone; say how many (one line)."""
    removed = []
    for p in stale_buffers(shm_dir, grace_s):
        try:
            p.unlink()
            removed.append(p.name)
        except FileNotFoundError:  # another process swept it first
            pass
    if removed:
        shown = ", ".join(removed[:4]) + (f", ... ({len(removed) - 4} more)" if len(removed) > 4 else "")
        print(
            f"ds_clip.shm: removed {len(removed)} stale DeepSpeed shared-memory buffer(s) from {shm_dir} "
            f"(no live process maps them): {shown}",
            flush=True,
        )
    return len(removed)


def release_own(rank: int, shm_dir: Path = SHM_DIR) -> bool:
    """Unlink this rank's buffer (call only once every rank has mapped it). True if there was one."""
    try:
        (shm_dir / buffer_name(rank)).unlink()
        return True
    except FileNotFoundError:  # no shm op (GPU, torchrun, several hosts) or already released
        return False


def unlink_own_at_exit(rank: int, shm_dir: Path = SHM_DIR) -> None:
    """At interpreter exit, unlink this rank's buffer if it is still there."""
    atexit.register(release_own, rank, shm_dir)
