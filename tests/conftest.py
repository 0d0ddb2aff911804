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


# How scripts/test.sh runs the suite: two pytest-xdist workers (`-n 2 --dist loadscope --no-loadscope-reorder`)
# on a 2-core machine. A launched run keeps one core idle for much of its life (the launcher's imports, rank 0
# saving or evaluating while the others wait, a pip download, SLURM's scheduling), and a second worker fills it.
#
# Each module is one work unit (pytest_xdist_make_scheduler below), so its module-scoped fixtures (process groups
# that train many cases, trained runs to resume, a fresh venv) are built once, on one worker. Modules that must
# not overlap share a unit: the two fresh-venv installs (several GB of disk each; a CI disk holds one at a time).
SHARED_GROUPS = {
    "tests/test_install.py": "fresh-venvs",
    "tests/test_install_oldest.py": "fresh-venvs",
}

# The modules that take minutes, longest first (scripts/test.sh prints each module's total at the end): the
# workers start them first, so that the short modules fill in at the end and both workers finish together.
# A module that grows past a few minutes goes in here (docs/start.md, "How long the suite may take").
LONGEST_FIRST = (
    "tests/test_install.py",  # with tests/test_install_oldest.py: one group, two fresh venvs in turn
    "tests/test_equivalence.py",
    "tests/test_checkpoint.py",
    "tests/faults/test_faults.py",
    "tests/test_hub.py",
    "tests/test_remote.py",
    "tests/test_slurm.py",
    "tests/test_stage_change.py",
    "tests/faults/test_signals.py",
    "tests/test_elastic.py",
    "tests/test_multinode.py",
    "tests/test_e2e.py",
    "tests/test_feature_pairs.py",
    "tests/test_hf_export.py",
    "tests/test_ema.py",
    "tests/faults/test_eval_faults.py",
    "tests/test_lock.py",
    "tests/test_compile.py",
    "tests/test_public_ds_configs.py",
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit(nodeid: str) -> str:
    module = _module(nodeid)
    return SHARED_GROUPS.get(module, module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope scheduling with our units: a module, or its SHARED_GROUPS name. (Not `--dist loadgroup`
    with xdist_group marks: xdist suffixes `item._nodeid` with the group, which pytest 9 no longer reads into
    `item.nodeid`, so every test became its own unit, a module's tests spread over both workers and each worker
    built the module's fixtures: a fresh venv, a SLURM cluster, a process group's runs twice.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config, items):
    order = {m: i for i, m in enumerate(LONGEST_FIRST)}
    by_group: dict[str, int] = {}
    for item in items:
        by_group.setdefault(_unit(item.nodeid), order.get(_module(item.nodeid), len(order)))
    # Stable: within a group, and among the modules not listed, collection order stays.
    items.sort(key=lambda item: by_group[_unit(item.nodeid)])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each module's total (setup + call + teardown of its tests, its module fixtures included), longest first:
    where the suite's time goes. Under two workers the totals add up to more than the wall time."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown") and hasattr(rep, "duration"):
                module = _module(rep.nodeid)
                totals[module] = totals.get(module, 0.0) + rep.duration
    if not totals:
        return
    tr = terminalreporter
    tr.write_sep("=", f"per-module totals ({len(totals)} modules, {sum(totals.values()):.0f} s in all)")
    for module, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:9.1f}s  {module}")
