"""On the CPU accelerator a process started as ds-clip-train starts keeps freed host memory for the next pass
(ds_clip.host_memory), and a user's own malloc choice, or turning it off, wins.

Each case is a fresh interpreter (allocator settings are per process) that starts the process group as a launched
rank does (``init_distributed``) and then frees and reallocates 200 MB in 2 MB blocks, as a forward and backward
do with activations and gradients; the pages faulted after the first round are what the kernel had to hand back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_clip import host_memory

REPO = Path(__file__).resolve().parents[1]

_PATTERN = """
import json, resource
import torch
from ds_clip import host_memory
from ds_clip.distributed import init_distributed

init_distributed()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

counts = []
for _ in range(3):
    before = faults()
    blocks = [torch.ones(512 * 1024) for _ in range(100)]  # 100 x 2 MiB, every page written
    counts.append(faults() - before)
    del blocks
print(json.dumps({"applied": host_memory.keep_freed_memory(), "faults": counts}))
"""

_PAGES = 100 * 2 * 1024 * 1024 // 4096


def _run(extra_env: dict[str, str]) -> dict:
    drop = ("GLIBC_TUNABLES", "LD_PRELOAD", "RANK", "WORLD_SIZE", "DS_CLIP_KEEP_FREED_MEMORY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra_env)
    out = subprocess.run(
        [sys.executable, "-c", _PATTERN], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_cpu_rank_reuses_freed_memory_and_a_user_choice_wins():
    kept = _run({})
    assert kept["applied"] is True
    # Reused: of the 51 200 pages each round writes, the second round faults a few (2-8 thousand measured: the heap's
    # layout settles) and the third (almost) none.
    assert kept["faults"][1] < _PAGES // 4 and kept["faults"][2] < _PAGES // 10, kept

    # Turned off: glibc's own dynamic thresholds unmapped the first round's blocks, and the second round faults
    # its pages in again (what every CPU run paid before, in whichever pass the heap's top was trimmed).
    off = _run({"DS_CLIP_KEEP_FREED_MEMORY": "0"})
    assert off["applied"] is False
    assert off["faults"][1] > _PAGES // 2, off

    # The user's own glibc setting is left alone.
    own = _run({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert own["applied"] is False


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({}, None),
        ({"DS_CLIP_KEEP_FREED_MEMORY": "0"}, "DS_CLIP_KEEP_FREED_MEMORY=0"),
        ({"DS_CLIP_KEEP_FREED_MEMORY": "1"}, None),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}, None),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD loads jemalloc"),
        ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "LD_PRELOAD loads tcmalloc"),
        ({"LD_PRELOAD": "/opt/lib/libfoo.so"}, None),
    ],
)
def test_what_counts_as_the_users_choice(env, reason):
    assert host_memory.user_choice(env) == reason
