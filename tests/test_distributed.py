"""Rank discovery from the launchers' environments (single process, no process group)."""

from __future__ import annotations

import pytest

from ds_clip import distributed


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node07", "node07"), ("gpu[03-05,07]", "gpu03"), ("a,b", "a"), ("rack1-n[12,14]", "rack1-n12")],
)
def test_first_slurm_host(nodelist, host):
    """MASTER_ADDR under srun is the first host of the step's node list, in SLURM's compressed syntax."""
    assert distributed._first_slurm_host(nodelist) == host


def test_srun_environment_becomes_torch_environment(monkeypatch):
    """srun sets only SLURM_*; ds_clip maps them to RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/PORT."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[03-04]")
    distributed._slurm_to_env()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")
    assert os.environ["MASTER_ADDR"] == "gpu03" and os.environ["MASTER_PORT"] == "29500"


def test_launcher_environment_wins_over_slurm(monkeypatch):
    """Under torchrun/deepspeed inside a SLURM allocation, their RANK is kept."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SLURM_PROCID", "3")
    distributed._slurm_to_env()
    import os

    assert os.environ["RANK"] == "0"
