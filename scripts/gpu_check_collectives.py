"""Every collective helper of ds_clip.distributed on a real NCCL process group (part (a) of gpu_check.sh).

    DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 torchrun --standalone --nproc_per_node 1 \
        scripts/gpu_check_collectives.py --out RESULT.json

Under NCCL a collective on a CPU tensor raises "No backend type associated with device type cpu"; CPU
tests (gloo) cannot show it. Each helper is called with a CPU tensor (it must come back on the CPU) and
with a tensor on the GPU (it must stay there), on a group of one rank with the helpers forced to issue
their collectives (DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1). Any failure raises: a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--allow-cpu", action="store_true", help="also run on a CPU accelerator (gloo): a smoke test"
    )
    a = p.parse_args()
    os.environ.setdefault("DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE", "1")
    import torch.distributed as dist

    from ds_clip import distributed as D

    info = D.init_distributed()
    dev = D.device()
    backend = dist.get_backend()
    if not a.allow_cpu and (dev.type != "cuda" or backend != "nccl"):
        sys.exit(f"gpu_check_collectives: expected a CUDA device and NCCL, got {dev} and {backend}")
    if D._single():
        sys.exit("gpu_check_collectives: DS_CLIP_COLLECTIVES_IN_WORLD_OF_ONE=1 must be set (or W > 1)")
    checked: dict[str, list[str]] = {}

    def where(name: str, t_in: torch.Tensor, t_out: torch.Tensor) -> None:
        want = t_in.device.type
        if t_out.device.type != want:
            raise AssertionError(f"{name}: input on {t_in.device}, result on {t_out.device}")
        checked.setdefault(name, []).append(str(t_in.device))

    for home in ("cpu", dev):
        x = torch.tensor([1.0, -2.0, 3.0], device=home)
        for fn in (D.all_reduce_mean, D.all_reduce_sum, D.all_reduce_max, D.all_reduce_min):
            out = fn(x)
            torch.testing.assert_close(out.cpu(), x.cpu())  # one rank: the value itself
            where(fn.__name__, x, out)
        i64 = torch.tensor([7, -7], dtype=torch.int64, device=home)
        where("all_reduce_max[int64]", i64, D.all_reduce_max(i64))
        rows = torch.arange(6.0, device=home).reshape(3, 2)
        where("all_gather_rows", rows, D.all_gather_rows(rows))
        where("all_gather_cat", rows, D.all_gather_cat(rows))
        leaf = rows.clone().requires_grad_(True)
        out = D.all_gather_cat_with_grad(leaf)
        out.sum().backward()
        torch.testing.assert_close(leaf.grad.cpu(), torch.ones(3, 2))
        where("all_gather_cat_with_grad", leaf, out)
        flag = torch.tensor([False, True], device=home)
        assert D.any_rank(flag) is True and D.any_rank(torch.tensor(False, device=home)) is False
        checked.setdefault("any_rank[tensor]", []).append(str(home))
    assert D.any_rank(True) is True and D.any_rank(False) is False
    checked["any_rank[bool]"] = ["-"]
    assert D.broadcast_object({"a": 1}, src=0) == {"a": 1}
    checked["broadcast_object"] = ["-"]
    assert D.all_gather_object(("r", info.rank)) == [("r", 0)]
    checked["all_gather_object"] = ["-"]
    D.barrier()
    checked["barrier"] = ["-"]
    result = {
        "backend": backend,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "world_size": info.world_size,
        "helpers_checked": checked,
        "ok": True,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
