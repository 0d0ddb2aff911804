"""What the weight EMA (--ema-decay) costs per optimizer step and in memory, on ZeRO 0-3 with ds-clip-train's
defaults (fp32, the shipped zero{0..3}_fp32 presets, AdamW), on W ranks of this machine.

    python benchmarks/bench_ema.py                                   # ds-clip-tiny, 2 ranks, m=16, k=1
    python benchmarks/bench_ema.py --model ViT-B-32 --force-image-size 64 --batch-size 4 --stages 0 1 2 3 \\
        --json benchmarks/results/raw/ema_cpu_vitb32.json

One process group of W ranks over gloo; for each stage one engine (built by ds_clip.training.engine from ds-clip-train
flags, as the trainer builds it) trains ``--steps`` cached steps on generated pairs; after each step the EMA
update (``WeightEma.maybe_update``: one ``torch._foreach_lerp_`` over this rank's master partitions, no
collective) is timed on its own, and so is one evaluation swap (``swapped_in``: masters saved, the EMA copied in,
DeepSpeed's refresh of the working copy, and back). Memory: the EMA's own bytes on each rank (exactly
4 x the elements of the rank's master partitions) and the process's resident memory before and after the EMA
is created. Wall time on the CPU, the median over steps; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* and ds_clip_harness must import
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_accum import machine_info  # noqa: E402


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure_stage(a: dict[str, Any], stage: int) -> dict[str, Any]:
    """Every rank: one engine on ZeRO ``stage``; rank 0's figures (and the largest EMA partition of any rank)."""
    import torch

    from ds_clip import distributed
    from ds_clip.config import parse_settings
    from ds_clip.step.ema import build_ema
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import RunSpec, step_micro_batches

    flags = ["--model", a["model"], "--batch-size", str(a["batch_size"]), "--accum-freq", str(a["accum_freq"]),
             "--zero-stage", str(stage), "--workers", "0", "--warmup", "0"]  # fmt: skip
    if a["force_image_size"]:
        flags += ["--force-image-size", str(a["force_image_size"])]
    world = distributed.world_size()
    rank = distributed.rank()
    # The step without an EMA, which is built below on its own, so that its memory and time are measured apart.
    trained = build_run_step(parse_settings(flags), world_size=world, rank=rank, total_steps=10**6)
    engine, bundle = trained.engine, trained.bundle
    spec = RunSpec(model=a["model"], micro_batch_size=a["batch_size"], accum_freq=a["accum_freq"], steps=1)
    engine.train()

    def step(i: int) -> float:
        batches, gids = step_micro_batches(spec, bundle.model_cfg, i, rank, world)
        distributed.barrier()
        t = time.perf_counter()
        trained.train(batches, step=i, micro_batch_ids=gids)
        return time.perf_counter() - t

    step(0)  # warm-up (Adam creates its state at the first step)
    rss_before = _rss_mib()
    ema = build_ema(engine, parse_settings([*flags, "--ema-decay", "0.9999"]).ema)
    assert ema is not None
    rss_after = _rss_mib()
    step_s, update_s = [], []
    for i in range(1, a["steps"] + 1):
        step_s.append(step(i))
        t = time.perf_counter()
        ema.maybe_update(i)
        update_s.append(time.perf_counter() - t)
    distributed.barrier()
    t = time.perf_counter()
    with ema.swapped_in():
        pass
    swap_s = time.perf_counter() - t
    ema_bytes = torch.tensor([float(ema.num_elements * 4)])
    largest = float(distributed.all_reduce_max(ema_bytes))
    num_params = sum(int(torch.Size(v).numel()) for v in ema.shapes.values())
    out = {
        "zero_stage": stage,
        "world_size": world,
        "masters": ema.where.kind,
        "params": num_params,
        "step_s": statistics.median(step_s),
        "ema_update_s": statistics.median(update_s),
        "ema_update_over_step": statistics.median(update_s) / statistics.median(step_s),
        "swap_in_and_out_s": swap_s,
        "ema_mib_rank0": ema.num_elements * 4 / 2**20,
        "ema_mib_largest_rank": largest / 2**20,
        "full_fp32_mib": num_params * 4 / 2**20,
        "rss_added_mib_rank0": rss_after - rss_before,
        "ema_device": str(ema.flats[0].device) if ema.flats else "-",
        "steps": step_s,
        "updates": update_s,
    }
    engine.destroy()
    return out


def _group(a: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(a["threads"])
    return [_measure_stage(a, z) for z in a["stages"]]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ZeRO | W | masters | step | EMA update | update / step | swap in + out | EMA per rank (of full fp32) | "
        "RSS added |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['zero_stage']} | {r['world_size']} | {r['masters']} | {r['step_s'] * 1e3:.0f} ms "
            f"| {r['ema_update_s'] * 1e3:.2f} ms | {r['ema_update_over_step']:.2%} | {r['swap_in_and_out_s'] * 1e3:.1f} ms "
            f"| {r['ema_mib_rank0']:.1f} MiB ({r['ema_mib_rank0'] / r['full_fp32_mib']:.0%} of {r['full_fp32_mib']:.1f}) "
            f"| {r['rss_added_mib_rank0']:.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_ema.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ds-clip-tiny")
    p.add_argument("--force-image-size", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16, help="m, pairs per micro-batch")
    p.add_argument("--accum-freq", type=int, default=1, help="k")
    p.add_argument("--world-size", type=int, default=2, help="W, local ranks over gloo")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=5, help="timed steps per stage (after one untimed)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", type=Path, help="write the measurements and the machine here")
    args = p.parse_args(argv)
    from ds_clip_harness.groups import spawn_group

    machine = machine_info("cpu")
    rows = spawn_group(args.world_size, _group, vars(args))
    machine["loadavg_after"] = list(os.getloadavg())
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": "python benchmarks/bench_ema.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine, "settings": {k: v for k, v in vars(args).items() if k != "json"}, "table": table,
            "rows": rows,
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
