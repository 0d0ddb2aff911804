"""Rank discovery from the launchers' environments (single process, no process group)."""

from __future__ import annotations

import os

import pytest

from ds_clip import distributed


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node07", "node07"), ("gpu[03-05,07]", "gpu03"), ("a,b", "a"), ("rack1-n[12,14]", "rack1-n12")],
)
def test_first_slurm_host(nodelist, host):
    """MASTER_ADDR under srun is the first host of the step's node list, in SLURM's compressed syntax."""
    assert distributed._first_slurm_host(nodelist) == host


def _isolated_env(monkeypatch, **env: str) -> dict[str, str]:
    # _slurm_to_env writes os.environ; give it a private one so nothing leaks into later tests.
    fake = dict(env)
    monkeypatch.setattr(os, "environ", fake)
    return fake


def test_srun_environment_becomes_torch_environment(monkeypatch):
    """srun sets only SLURM_*; ds_clip maps them to RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/PORT."""
    env = _isolated_env(
        monkeypatch, SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_STEP_NODELIST="gpu[03-04]"
    )
    distributed._slurm_to_env()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")
    assert env["MASTER_ADDR"] == "gpu03" and env["MASTER_PORT"] == "29500"


def test_launcher_environment_wins_over_slurm(monkeypatch):
    """Under torchrun/deepspeed inside a SLURM allocation, their RANK is kept."""
    env = _isolated_env(monkeypatch, RANK="0", SLURM_PROCID="3", SLURM_NTASKS="8")
    distributed._slurm_to_env()
    assert env["RANK"] == "0" and "MASTER_ADDR" not in env


def _average_on_ranks() -> list:
    """Rank r holds tensors filled from r; after average_in_place every rank holds the mean over ranks."""
    import torch

    rank, world = distributed.rank(), distributed.world_size()
    shapes = [(3,), (distributed.SMALL_GRADIENT_ELEMENTS,), (7, 5), (300, 400), (1,)]  # small and large
    tensors = [
        torch.arange(int(torch.tensor(s).prod()), dtype=torch.float32).reshape(s) * (rank + 1) for s in shapes
    ]
    ids = [id(t) for t in tensors]
    distributed.average_in_place(tensors)
    mean = sum(r + 1 for r in range(world)) / world
    return [
        (t.shape, bool(torch.equal(t, torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) * mean)))
        for t in tensors
    ] + [[id(t) for t in tensors] == ids]


@pytest.mark.distributed
def test_average_in_place_on_two_ranks():
    """distributed.average_in_place (ZeRO-0's gradient average on several fp32 ranks) leaves the mean over the
    ranks in every tensor, in place: small tensors through one flattened message, large ones where they lie."""
    from ds_clip_harness.groups import spawn_group

    *checks, same_objects = spawn_group(2, _average_on_ranks)
    assert all(ok for _, ok in checks), checks
    assert same_objects
