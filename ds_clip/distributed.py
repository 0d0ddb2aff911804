"""Process-group start-up and every collective ds_clip issues itself (the one home for them).

The same code runs on CPU (gloo) and GPU (NCCL): DeepSpeed picks the accelerator and backend, and
reads rank and world size from whichever launcher started us (deepspeed, torchrun, SLURM, or mpirun
through mpi4py).

Why every collective lives here: under NCCL a process group has no backend for CPU tensors (a
collective on one raises ``No backend type associated with device type cpu``), and gloo accepts
them, so CPU tests never show the bug. The helpers below put what they send on the accelerator's
current device (``device()``), and hand results back where the caller's tensor was: a CPU tensor
in, a CPU tensor out; a device tensor stays on the device. No other ds_clip module calls
``torch.distributed`` (or ``torch.distributed.nn``, ``deepspeed.comm``) collectives: a test scans
the package's source for that (tests/test_collectives.py), and a guard (tests/collective_guard.py)
runs the trainer, evaluation and checkpoints with every collective recorded.

The guard needs "on the accelerator" to be observable on a CPU-only machine: it replaces placement
through ``set_placement`` with a simulated device (a tensor subclass that survives every op and turns back
into a plain tensor on ``.cpu()``), so a tensor handed to a collective that never went through
``to_device`` is a plain tensor, exactly the one NCCL would refuse. A run never sets it: placement is
``t.to(device())`` behind one ``is None`` check.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from ds_clip import host_memory, shm
from ds_clip.errors import UserError

T = TypeVar("T")


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
        # NCCL needs one GPU per rank chosen before the first collective (object collectives such as
        # broadcast_object use the current device): LOCAL_RANK is known by now (MPI discovery included).
        _set_local_device()
        if _local_rank() == 0:
            shm.sweep_stale()  # buffers of earlier runs whose ranks are gone (SIGKILLed, say)
        _init_after_elastic_restart(timeout_s)
        deepspeed.init_distributed(  # wraps the group started above, if any
            auto_mpi_discovery=launched_by_mpi, timeout=timedelta(seconds=timeout_s), verbose=False
        )
        _release_shm_buffers()
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), report)


def _init_after_elastic_restart(timeout_s: float) -> None:
    """Under torchrun's elastic agent, after a restart: start the default group on a store keyed by the attempt.

    The agent serves the workers' store from one TCPStore server it keeps across rendezvous rounds, and the
    workers' client (torch's env:// rendezvous with TORCHELASTIC_USE_AGENT_STORE) adds no per-attempt prefix.
    Keys of the dead attempt stay: a gloo group created after a restart (DeepSpeed's clone of the world group)
    reads a dead rank's address under its key and waits forever (seen with torch 2.14: both survivors stuck in
    gloo's waitUntilConnected). A PrefixStore per TORCHELASTIC_RESTART_COUNT gives each attempt its own keys.
    The first attempt keeps torch's own path."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in ("", "0"):
        return
    from deepspeed.accelerator import get_accelerator

    timeout = timedelta(seconds=timeout_s)
    world = int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"ds_clip/elastic_attempt_{attempt}", client)
    dist.init_process_group(
        get_accelerator().communication_backend_name(),
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=timeout,
    )


def _release_shm_buffers() -> None:
    """Unlink this rank's DeepSpeed CPU shm buffer once every rank has mapped every buffer (ds_clip/shm.py).

    DeepSpeed's CPU accelerator starts its shared-memory comm op inside ``init_distributed`` when all
    ranks run on this host (``LOCAL_SIZE`` equals the world size, as the deepspeed launcher sets it), the
    same condition on every rank, so either every rank enters the barrier below or none does. After the
    barrier no rank opens a buffer by name again; the mappings outlive the names.
    """
    import deepspeed.comm as ds_comm

    backend = getattr(ds_comm.comm, "cdb", None)
    if getattr(backend, "shm_comm_op", None) is None or os.environ.get("LOCAL_SIZE") != str(
        dist.get_world_size()
    ):
        return
    shm.unlink_own_at_exit(dist.get_rank())
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank has left shm_initialize: each has mapped every rank's buffer
    shm.release_own(dist.get_rank())


def _local_rank() -> int:
    for key in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def accelerator_name() -> str:
    """DeepSpeed's accelerator on this machine ("cuda", "cpu", ...): what the DeepSpeed JSON is resolved for
    (ds_clip.ds_config.resolve.resolve_deepspeed decides what it cannot run)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _set_local_device() -> None:
    """Make GPU LOCAL_RANK this process's current device; on a CPU accelerator, keep freed host memory
    (``host_memory``)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        # The model's activations and gradients are host memory: keep what a pass frees for the next one.
        host_memory.keep_freed_memory()
        return
    local = _local_rank()
    count = acc.device_count()
    if local >= count:
        raise RuntimeError(
            f"LOCAL_RANK {local} but this host has {count} {acc.device_name()} device(s): start at most "
            f"{count} ranks per host (one per device), e.g. deepspeed --num_gpus {count}"
        )
    acc.set_device(local)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------------------------------- placement

WORLD_OF_ONE_ENV = "DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE"
"""Set to 1 to make the helpers issue their collectives in a process group of one rank too (by default a
world of one issues none): scripts/gpu_check.sh uses it so that a 1-GPU NCCL run exercises every one."""


def _single() -> bool:
    """True where the helpers skip the collective: no process group, or one rank (unless WORLD_OF_ONE_ENV)."""
    if not dist.is_initialized():
        return True
    return dist.get_world_size() == 1 and os.environ.get(WORLD_OF_ONE_ENV) != "1"


def device() -> torch.device:
    """The accelerator's current device (``cuda:LOCAL_RANK`` on GPUs, ``cpu`` on the CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


class Placement(Protocol):
    """What ``to_device`` returns and what ``is_on_device`` accepts, where ``set_placement`` replaces them."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor: ...

    def is_on_device(self, t: torch.Tensor) -> bool: ...


_placement: Placement | None = None


def set_placement(placement: Placement | None) -> None:
    """Replace placement on the accelerator's device with ``placement`` (None: ``t.to(device())`` again).

    For the collective guard (tests/collective_guard.py), which makes "on the accelerator" observable on a
    CPU-only machine; a training run never calls it."""
    global _placement
    _placement = placement


def is_on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the accelerator's current device (under the guard: went through ``to_device``)."""
    if _placement is not None:
        return _placement.is_on_device(t)
    d = device()
    return t.device.type == d.type and (d.index is None or t.device.index == d.index)


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the accelerator's current device (no copy if it is there already; autograd-transparent)."""
    if _placement is not None:
        return _placement.to_device(t)
    return t.to(device(), non_blocking=True) if not is_on_device(t) else t


def _back_home(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``result`` (on the device) moved to where the caller's tensor ``like`` was."""
    if is_on_device(like):
        return result
    # A copy to the host is a sync point: the caller asked for a host tensor.
    return result.to(like.device)


# ----------------------------------------------------------------------------------------- reductions


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if _single():
        return t.detach().clone()  # no collective, no trip to the device
    out = to_device(t.detach()).clone()
    dist.all_reduce(out, op=op)
    return _back_home(out, t)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; the input is untouched; a world of one issues no collective)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (a copy, in ``t``'s dtype: give it a floating-point tensor)."""
    out = _all_reduce(t, dist.ReduceOp.SUM)
    if not _single():
        out /= world_size()
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum over ranks (a copy)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    """Elementwise minimum over ranks (a copy)."""
    return _all_reduce(t, dist.ReduceOp.MIN)


# Gradients below this many elements travel together in one flattened message (one call's latency for the many
# biases and norms); larger ones are reduced where they lie, with no copy.
SMALL_GRADIENT_ELEMENTS = 1 << 16


def average_in_place(tensors: list[torch.Tensor]) -> None:
    """Average each tensor over the ranks, in place, as DeepSpeed's ZeRO-0 all-reduce does (sum, then times
    1/W) but without flattening the large ones into a copy of the whole gradient first: each tensor of at least
    SMALL_GRADIENT_ELEMENTS is all-reduced where it lies, the small ones together in one flattened message.
    Through DeepSpeed's comm wrapper, so its comms logger counts these reductions like its own. A collective:
    every rank passes the same shapes in the same order; a world of one issues nothing."""
    if _single() or not tensors:
        return
    from deepspeed import comm as ds_comm

    scale = 1.0 / world_size()
    small = [t for t in tensors if t.numel() < SMALL_GRADIENT_ELEMENTS]
    if small:
        flat = to_device(torch.cat([t.reshape(-1) for t in small]))
        ds_comm.all_reduce(flat)
        flat.mul_(scale)
        for t, part in zip(small, flat.split([t.numel() for t in small])):
            t.copy_(part.view_as(t))
    for t in tensors:
        if t.numel() >= SMALL_GRADIENT_ELEMENTS:
            out = to_device(t)  # the tensor itself when it is on the device already (gradients are)
            ds_comm.all_reduce(out)
            out.mul_(scale)
            if out is not t:
                t.copy_(out)


def any_rank(flag: bool | torch.Tensor) -> bool:
    """True on every rank if ``flag`` is true on any rank: one 4-byte all-reduce, so that all ranks
    take the same branch (skip a step, stop for a signal). A collective: call it on every rank.

    ``flag`` may be a bool tensor on the device (e.g. ``~torch.isfinite(loss)``): the all-reduce runs on
    the device and the one host sync is the final ``bool``.
    """
    if _single():
        return bool(flag.any()) if isinstance(flag, torch.Tensor) else bool(flag)
    if isinstance(flag, torch.Tensor):
        t = to_device(flag.detach().reshape(-1).any().to(torch.float32).reshape(1))
    else:
        t = to_device(torch.tensor([1.0 if flag else 0.0]))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)  # the one host sync


# ------------------------------------------------------------------------------------------- objects


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` (picklable), on every rank. Torch moves the pickled bytes through the
    current device under NCCL: ``init_distributed`` chose it."""
    if _single():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if _single():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def failures(error: str | None) -> list[tuple[int, str]]:
    """A collective: (rank, message) of every rank whose part failed (``error``: what failed here, None if
    nothing), in rank order, the same on every rank; [] when nothing failed. One 4-byte all-reduce when all went
    well; the messages travel only after a failure. A rank that fails alone thus says so at an agreed point
    instead of leaving the others waiting in their next collective until the process-group timeout."""
    if not any_rank(error is not None):
        return []
    return [(r, m) for r, m in enumerate(all_gather_object(error)) if m]


def agree_on_user_error(error: UserError | None) -> None:
    """A collective: when bad input was found on any rank (``error``: this rank's, None if none), every rank
    raises one ``UserError`` with the first failing rank's message, which the entry point prints once per job
    (rank 0; ``UserError.same_on_every_rank``). The rank is named when not every rank found the same."""
    failed = failures(None if error is None else str(error))
    if not failed:
        return
    r, message = failed[0]
    if len(failed) < world_size() or any(m != message for _, m in failed):
        message = f"rank {r}: {message}"
    raise UserError(message)


def agreed(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank (a check, or a builder that checks its input), its bad input agreed on
    (``agree_on_user_error``): a file each rank reads on its own host is reported once per job, not once per
    rank, and no rank is left waiting for one that gave up."""
    try:
        out, error = fn(), None
    except UserError as exc:
        out, error = None, exc
    agree_on_user_error(error)
    return out  # type: ignore[return-value]


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if not _single():
        dist.barrier()


# ------------------------------------------------------------------------------------------- gathers


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``t`` concatenated in rank order; row counts may differ by rank (no grad).

    Two gathers: the counts, then the rows padded to the largest count.
    """
    if _single():
        return t.detach()
    world = world_size()
    x = to_device(t.detach())
    n = to_device(torch.tensor([x.shape[0]], dtype=torch.long))
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n)
    sizes = torch.cat(counts).tolist()  # host sync: the shapes below depend on it
    most = max(sizes)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return _back_home(torch.cat([p[:c] for p, c in zip(parts, sizes)]), t)


def _gather_equal(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (same shape on every rank) concatenated along dim 0 in rank order; no grad."""
    if _single():
        return t.detach()
    return _back_home(_gather_equal(to_device(t.detach()).contiguous()), t)


def _sum_own_rows(g: torch.Tensor, rows: int) -> torch.Tensor:
    """Sum over ranks of ``g`` ([W * rows, ...] on every rank), keeping this rank's ``rows`` rows."""
    start = rank() * rows
    if dist.get_backend() == "nccl":
        out = g.new_empty((rows, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g.contiguous())
        return out
    # gloo has no reduce-scatter: all-reduce the whole gradient and keep our slice.
    total = g.contiguous().clone()
    dist.all_reduce(total)
    return total[start : start + rows]


class _AllGatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums every rank's gradient of this rank's rows (as
    ``torch.distributed.nn.all_gather``, which open_clip's gather-with-grad uses), with both directions
    issued from here so that they run on the device."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.rows = t.shape[0]
        return _gather_equal(t.contiguous())

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return _sum_own_rows(to_device(g), ctx.rows)


def all_gather_cat_with_grad(t: torch.Tensor) -> torch.Tensor:
    """``all_gather_cat`` whose backward reduces: the gradient of every rank's use of this rank's rows
    arrives back here, summed (the loss's ``--gather-with-grad``)."""
    if _single():
        return t
    return _back_home(_AllGatherWithGrad.apply(to_device(t)), t)


__all__ = [
    "WORLD_OF_ONE_ENV",
    "DistInfo",
    "Placement",
    "accelerator_name",
    "all_gather_cat",
    "all_gather_cat_with_grad",
    "all_gather_object",
    "all_gather_rows",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_min",
    "all_reduce_sum",
    "any_rank",
    "barrier",
    "broadcast_object",
    "device",
    "init_distributed",
    "is_on_device",
    "rank",
    "set_placement",
    "to_device",
    "world_size",
]
