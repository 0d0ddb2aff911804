"""What skipping a fully locked tower's recompute saves (LiT: --lock-image), per optimizer step, on one rank.

    python benchmarks/bench_lock.py                                  # ds-clip-tiny, m=16, k=4, ZeRO-0, ~1 min
    python benchmarks/bench_lock.py --model ds-clip-tiny --force-image-size 128 --batch-size 16 --accum-freq 4

One DeepSpeed engine (the trainer's, from ds-clip-train flags with --lock-image) runs two modes interleaved
step by step on the same weights: "skip" (ds_clip's cached step: the locked image tower is embedded once per
micro-batch, phase 3 runs only the text tower) and "recompute" (the same step with the skip turned off, so
phase 3 runs the whole model again for micro-batches 1..k-1, as it would without the rule). It also times
one image-tower forward of m pairs under no_grad. The saving per step should be about (k-1) such forwards:
micro-batch 0 is never recomputed anyway. Wall time on the CPU; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="ds-clip-tiny")
    p.add_argument("--force-image-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accum-freq", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from ds_clip.distributed import _free_port, init_distributed

    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    init_distributed()
    import ds_clip.step.cached as step_mod
    from ds_clip.config import parse_settings
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import RunSpec, step_micro_batches

    flags = ["--model", args.model, "--lock-image", "--batch-size", str(args.batch_size), "--accum-freq",
             str(args.accum_freq), "--zero-stage", "0", "--workers", "0", "--warmup", "0"]  # fmt: skip
    if args.force_image_size:
        flags += ["--force-image-size", str(args.force_image_size)]
    s = parse_settings(flags)
    trained = build_run_step(s, world_size=1, rank=0, total_steps=10**6)  # the step ds-clip-train trains
    engine, bundle = trained.engine, trained.bundle
    engine.train()
    spec = RunSpec(model=args.model, micro_batch_size=args.batch_size, accum_freq=args.accum_freq, steps=1)
    batches, _ = step_micro_batches(spec, bundle.model_cfg, 0, 0, 1)
    real = step_mod.frozen_towers

    def run(mode: str) -> float:
        step_mod.frozen_towers = real if mode == "skip" else (lambda m: (False, False))
        t = time.perf_counter()
        trained.train(batches)
        return time.perf_counter() - t

    def image_forward() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            engine(image=batches[0][0])
        return time.perf_counter() - t

    for mode in ("skip", "recompute"):  # warm-up
        run(mode)
    times: dict[str, list[float]] = {"skip": [], "recompute": [], "image_forward": []}
    for _ in range(args.steps):
        times["recompute"].append(run("recompute"))
        times["skip"].append(run("skip"))
        times["image_forward"].append(image_forward())
    step_mod.frozen_towers = real
    med = {k: statistics.median(v) for k, v in times.items()}
    k = args.accum_freq
    saved = med["recompute"] - med["skip"]
    print(
        f"{args.model} image {bundle.model_cfg['vision_cfg']['image_size']} px, m={args.batch_size}, k={k}, "
        f"1 rank ZeRO-0 fp32, median of {args.steps} steps, threads={torch.get_num_threads()}"
    )
    print(f"  step with the locked image tower recomputed: {med['recompute'] * 1e3:8.1f} ms")
    print(f"  step with its recompute skipped (ds_clip):   {med['skip'] * 1e3:8.1f} ms")
    print(f"  saved per step: {saved * 1e3:.1f} ms ({saved / med['recompute']:.1%}); "
          f"(k-1) x one image-tower forward of m = {(k - 1) * med['image_forward'] * 1e3:.1f} ms")  # fmt: skip
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
