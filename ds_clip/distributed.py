"""Process-group start-up and the few collectives ds_clip issues itself.

The same code runs on CPU (gloo) and GPU (NCCL): DeepSpeed picks the accelerator and backend, and
reads rank and world size from whichever launcher started us (deepspeed, torchrun, SLURM, or mpirun
through mpi4py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    hosts: Any = None
    """ds_clip.preflight.PreflightReport: which ranks run on which hosts (None when not checked)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_to_env() -> None:
    # srun sets SLURM_* only; DeepSpeed and torch read RANK/WORLD_SIZE/LOCAL_RANK.
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        os.environ["MASTER_ADDR"] = _first_slurm_host(nodes)


def _first_slurm_host(nodelist: str) -> str:
    # "node[03-05,07]" -> "node03"; "a,b" -> "a"
    head = nodelist.split(",")[0]
    if "[" in nodelist:
        prefix, rest = nodelist.split("[", 1)
        first = rest.split(",")[0].split("-")[0].rstrip("]")
        return prefix + first
    return head


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Start (or join) the default process group and return this process's place in it.

    A single process without any launcher also works: it becomes a world of one.
    """
    import deepspeed

    _slurm_to_env()
    launched_by_mpi = "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ
    if not launched_by_mpi and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    report = None
    if not dist.is_initialized():
        from ds_clip.preflight import check_rendezvous

        # Bounded check that every rank reaches the master, naming the host that does not,
        # instead of torch's rendezvous waiting out its whole timeout.
        report = check_rendezvous()
        deepspeed.init_distributed(
            auto_mpi_discovery=launched_by_mpi, timeout=timedelta(seconds=timeout_s), verbose=False
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), report)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks of a small tensor (a copy; the input is untouched)."""
    t = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(t)
        t /= world_size()
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank: one 4-byte all-reduce, so that all ranks
    take the same branch (skip a step, stop for a signal). A collective: call it on every rank."""
    if world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
