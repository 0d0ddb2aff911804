"""Suite-wide guard: a test must not leave a process group or launcher variables in the pytest process.

ds_clip.distributed.init_distributed, run in-process without a launcher, starts a world of one and sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. Left behind, they leak into every later test's
subprocesses (an mpirun rank then sees LOCAL_RANK=0 next to OMPI's local rank 1; a launched run tries to
listen on the pytest process's own MASTER_PORT). Run trainings in subprocesses or spawned groups instead.
"""

from __future__ import annotations

import os

import pytest

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    leaked = {k: os.environ.get(k) for k in LAUNCHER_VARS if os.environ.get(k) != before[k]}
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized()
    for k, v in before.items():  # restore, so one offender does not fail every later test
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if group:
        dist.destroy_process_group()
    if leaked or group:
        pytest.fail(
            f"this test left {'a process group and ' if group else ''}launcher variables {leaked} in the pytest "
            "process: run the trainer in a subprocess or a spawned group"
        )
