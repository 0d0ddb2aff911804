"""The host allocator when the model trains on the CPU: freed memory stays in the process for the next pass.

On the CPU accelerator every activation and gradient is host memory, and a training step frees and allocates
the same few hundred megabytes again in every forward and backward. glibc's malloc gives them back to the kernel
as they are freed: blocks above its mmap threshold are unmapped, and the top of the heap is trimmed once more than
its trim threshold is free (both thresholds move with what the process frees: "dynamic" thresholds). The next
pass then faults every page in again, zero-filled by the kernel. How much comes back depends on which block
happens to sit at the top of the heap, so it changes with the order of allocations. Measured on ViT-B-32 at 64
px, m = 4, one process (docs/cost.md): a plain loop settles at about 25 thousand faults per backward (the token
embedding's 101 MB gradient, above any threshold), while the cached step's recompute-then-backward pattern kept
faulting 64-88 thousand pages per backward and 16 thousand per recomputed forward, about 0.1 s per micro-batch.

``keep_freed_memory`` fixes both thresholds (which also turns their dynamic adjustment off): blocks up to 32 MiB
(glibc's largest mmap threshold) come from the heap, and the heap is trimmed only when more than 2 GiB at its top
is free. The process's peak is unchanged (the memory was in use at the peak); it is held between steps instead
of being handed back and faulted in again. ``ds_clip.distributed.init_distributed`` calls it when DeepSpeed's
accelerator is the CPU. On a GPU nothing changes: PyTorch's CUDA caching allocator already reuses freed device
blocks and host memory is a small share.

A choice the user made wins: with their own malloc settings in the environment (``GLIBC_TUNABLES`` naming
``glibc.malloc``, glibc's ``MALLOC_*_`` variables) or another allocator preloaded (jemalloc, tcmalloc, mimalloc
in ``LD_PRELOAD``), nothing is set. ``DS_CLIP_KEEP_FREED_MEMORY=0`` leaves glibc's own dynamic thresholds (setting
either threshold, even to its default value, turns the dynamic adjustment off, so a tunable cannot restore it).
Not glibc (musl, macOS): nothing is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["MMAP_THRESHOLD", "OPT_OUT", "TRIM_THRESHOLD", "keep_freed_memory", "user_choice"]

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 1024 * 1024
"""glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): mallopt refuses more."""
TRIM_THRESHOLD = 2**31 - 1
"""mallopt takes an int: the heap is trimmed only when about 2 GiB at its top is free."""

OPT_OUT = "DS_CLIP_KEEP_FREED_MEMORY"
"""Set to 0: glibc's own thresholds stay."""

_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")
_GLIBC_MALLOC_ENV = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)

_applied: bool | None = None


def user_choice(environ: dict[str, str] | None = None) -> str | None:
    """What in the environment says the user chose the allocator or its settings themselves (None: nothing)."""
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT, "").strip() == "0":
        return f"{OPT_OUT}=0"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    for name in _GLIBC_MALLOC_ENV:
        if name in env:
            return f"{name} is set"
    preload = env.get("LD_PRELOAD", "").lower()
    for allocator in _PRELOADED_ALLOCATORS:
        if allocator in preload:
            return f"LD_PRELOAD loads {allocator}"
    return None


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring). Once per process;
    True when they were set by this call or an earlier one."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    reason = user_choice()
    if reason is not None:
        logger.debug("host allocator left as chosen: %s", reason)
        return False
    if not _glibc():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success, 0 on error.
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _applied = mmap_ok and trim_ok
    logger.debug("host allocator: mmap threshold %s, trim threshold %s", mmap_ok, trim_ok)
    return _applied


def _glibc() -> bool:
    # confstr names the C library's version without reading the interpreter's binary (platform.libc_ver does).
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (not POSIX) or no such name (musl)
        return False
