"""Suite-wide guards: a module's folders go when its tests pass, and a test must not leave a process group or
launcher variables in the pytest process.

ds_clip.distributed.init_distributed, run in-process without a launcher, starts a world of one and sets
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. Left behind, they leak into every later test's
subprocesses (an mpirun rank then sees LOCAL_RANK=0 next to OMPI's local rank 1; a launched run tries to
listen on the pytest process's own MASTER_PORT). Run trainings in subprocesses or spawned groups instead.
"""

from __future__ import annotations

import os
import shutil

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


@pytest.fixture(scope="module", autouse=True)
def _module_folders_removed(request, tmp_path_factory):
    """What a module made under pytest's base temporary folder (its module-scoped fixtures' folders: trained
    runs, shards, SLURM state) is removed after the module, once its fixtures are torn down, unless one of its
    tests failed or the retention policy keeps everything. The suite as a whole writes tens of GB; a module
    alone writes at most a few."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.config.getini("tmp_path_retention_policy") == "all" or request.session.testsfailed > failed:
        return
    for made in set(base.iterdir()) - before:
        shutil.rmtree(made, ignore_errors=True)
