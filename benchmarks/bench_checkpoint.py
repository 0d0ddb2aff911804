"""What the manifest's checksums cost a save and a resume, on one rank (ViT-B-32 by default).

    python benchmarks/bench_checkpoint.py                         # ViT-B-32 at 64 px, ZeRO-0 fp32, ~3 min
    python benchmarks/bench_checkpoint.py --model ds-clip-tiny --repeats 5 --out benchmarks/results/raw/checkpoint_tiny.json

One DeepSpeed engine (the trainer's builder, from ds-clip-train flags) trains one step, so the checkpoint holds
the weights and both Adam moments, then saves it alternately with checksums (each file hashed right after
DeepSpeed writes it) and without (sizes only), ``--repeats`` times each into fresh folders, in alternating
order after one untimed save. The resume side
times ``checkpoint.verify`` (every file read and hashed) and ``checkpoint.load`` (DeepSpeed's load into the
engine) of the same checkpoint, and the hash alone on one in-memory buffer. Files are read back from the
page cache (they were just written); a cold read from disk adds the disk's read time to both the load and
the check. Wall time on the CPU; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--force-image-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: a temporary folder)"
    )
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    from ds_clip.distributed import _free_port, init_distributed

    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    init_distributed()
    import torch
    import xxhash

    from ds_clip import checkpoint
    from ds_clip.checkpoint.load import install_safe_loading
    from ds_clip.config import parse_settings
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import RunSpec, step_micro_batches

    flags = ["--model", args.model, "--batch-size", "2", "--accum-freq", "1", "--zero-stage", "0",
             "--workers", "0", "--warmup", "0", "--force-image-size", str(args.force_image_size)]  # fmt: skip
    s = parse_settings(flags)
    trained = build_run_step(s, world_size=1, rank=0, total_steps=10**6)
    engine = trained.engine
    spec = RunSpec(model=args.model, micro_batch_size=2, accum_freq=1, steps=1)
    batches, _ = step_micro_batches(spec, trained.bundle.model_cfg, 0, 0, 1)  # one step: Adam's moments exist
    trained.train(batches)
    install_safe_loading(engine)
    params = sum(p.numel() for p in engine.module.parameters())

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    times: dict[str, list[float]] = {"save_with_checksums_s": [], "save_sizes_only_s": [], "verify_s": [],
                                     "load_s": []}  # fmt: skip
    size = 0
    shutil.rmtree(
        checkpoint.save(engine, root / "warmup", 1, {}, {}, meta={}).parent.parent
    )  # first-time costs
    for i in range(args.repeats):
        for with_sums in (True, False) if i % 2 == 0 else (False, True):  # alternate: no order bias
            run = root / f"run{i}_{int(with_sums)}"
            t = time.perf_counter()
            path = checkpoint.save(engine, run, 1, {}, {}, meta={}, checksums=with_sums)
            key = "save_with_checksums_s" if with_sums else "save_sizes_only_s"
            times[key].append(time.perf_counter() - t)
            if with_sums:
                size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                t = time.perf_counter()
                checkpoint.verify(path, "--resume")
                times["verify_s"].append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.load_checkpoint(str(path.parent), tag=path.name)
                times["load_s"].append(time.perf_counter() - t)
            shutil.rmtree(run)
    buf = torch.empty(256 << 20, dtype=torch.uint8).numpy().tobytes()
    t = time.perf_counter()
    xxhash.xxh3_128(buf).hexdigest()
    hash_gib_s = len(buf) / 2**30 / (time.perf_counter() - t)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: _median(v) for k, v in times.items()}
    result = {
        "what": "checkpoint save and resume cost with and without the manifest's xxh3-128 checksums, one rank",
        "command": "python benchmarks/bench_checkpoint.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "image_px": args.force_image_size,
        "params": params,
        "checkpoint_bytes": size,
        "repeats": args.repeats,
        "median": med,
        "all": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "checksum_cost_on_save_s": round(med["save_with_checksums_s"] - med["save_sizes_only_s"], 4),
        "checksum_cost_on_save_pct": round(
            100 * (med["save_with_checksums_s"] / med["save_sizes_only_s"] - 1), 1
        ),
        "verify_vs_load_pct": round(100 * med["verify_s"] / med["load_s"], 1),
        "xxh3_128_gib_per_s_in_memory": round(hash_gib_s, 2),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, torch {torch.__version__}",
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
