"""Local process groups: W processes on this machine over gloo, as the launchers users run would start them.

``spawn_group(W, fn, *args)`` runs ``fn(*args)`` on every rank of one process group and returns rank 0's
result; the equivalence tests hand it ``runs.run_many`` and a list of specs, so that one group (one DeepSpeed
start-up per rank) trains many runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ds_clip import distributed


def _group_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # A spawned child inherits "spawn" as its default start method, so every DataLoader iterator here would
    # start its workers as fresh interpreters (seconds each: torch, open_clip, deepspeed imported again).
    # The launchers users run (deepspeed, torchrun, mpirun) start ranks as plain processes, whose
    # DataLoaders fork their workers: do what they do.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    from ds_clip.distributed import init_distributed

    init_distributed()
    # Everything imported so far (torch, DeepSpeed, open_clip: millions of objects) lives as long as the
    # process: move it out of the collector's way, so the full collections that many engine builds trigger
    # (DeepSpeed's ZeRO-3 defragment calls gc.collect()) scan only what the runs allocate.
    import gc

    gc.freeze()
    result = fn(*args)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    import torch.distributed as dist

    distributed.barrier()
    dist.destroy_process_group()


def spawn_group(world_size: int, fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world_size`` local processes over gloo; return rank 0's result."""
    import torch.multiprocessing as mp

    from ds_clip.distributed import _free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _group_entry,
            args=(world_size, _free_port(), fn, args, out_dir),
            nprocs=world_size,
            start_method="spawn",
        )
        return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)
