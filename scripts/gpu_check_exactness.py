"""Exactness on one GPU (part (c) of gpu_check.sh): k = 4 micro-batches of m vs k = 1 of 4m, fp32, TF32 off.

    torchrun --standalone --nproc_per_node 1 scripts/gpu_check_exactness.py --out RESULT.json

Both runs take one optimizer step on the same 4m pairs from the same weights (ds_clip_harness's
generated data, defined by sample index) and record DeepSpeed's reduced gradient of every parameter at
that step. The cached step promises the same gradient whatever the split: the relative error
||g(k=4, m) - g(k=1, 4m)|| / ||g(k=1, 4m)|| is reported per parameter (largest, and logit_scale's), per
ZeRO stage. TF32 is off so that fp32 means fp32. Above --max-rel-err the script fails (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--micro-batch-size", type=int, default=32, help="m of the k=4 run (the other has 4m)")
    p.add_argument("--zero-stages", type=int, nargs="+", default=[0, 2])
    p.add_argument("--max-rel-err", type=float, default=1e-4)
    p.add_argument("--allow-cpu", action="store_true", help="also run without CUDA (a smoke test)")
    a = p.parse_args()

    # fp32 means fp32: no TF32 in matmuls or convolutions (the patch embedding of a ViT is a convolution).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    from ds_clip.distributed import device, init_distributed
    from ds_clip_harness.runs import RunSpec, replace, run_in_group

    init_distributed()
    dev = device()
    if dev.type != "cuda" and not a.allow_cpu:
        sys.exit(f"gpu_check_exactness: expected a CUDA device, got {dev}")
    m = a.micro_batch_size
    results = []
    worst = 0.0
    for stage in a.zero_stages:
        split = RunSpec(
            model=a.model, micro_batch_size=m, accum_freq=4, steps=1, zero_stage=stage, capture_grads=True
        )
        whole = replace(split, micro_batch_size=4 * m, accum_freq=1)
        ga = run_in_group(split)
        gb = run_in_group(whole)
        errs = {n: rel_err(ga.grads[n], gb.grads[n]) for n in gb.grads if gb.grads[n] is not None}
        name, largest = max(errs.items(), key=lambda kv: kv[1])
        row = {
            "zero_stage": stage,
            "model": a.model,
            "k4_m": m,
            "k1_m": 4 * m,
            "params_compared": len(errs),
            "max_rel_err": largest,
            "max_rel_err_param": name,
            "logit_scale_rel_err": errs.get("logit_scale"),
            "loss_k4": ga.losses[0],
            "loss_k1": gb.losses[0],
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        worst = max(worst, largest)
    out = {
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "precision": "fp32",
        "runs": results,
        "max_rel_err": worst,
        "threshold": a.max_rel_err,
        "ok": worst <= a.max_rel_err,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    if not out["ok"]:
        print(
            f"gpu_check_exactness: relative gradient error {worst:.2e} > {a.max_rel_err:.0e}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
