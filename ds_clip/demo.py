"""Reproduce "4 GPUs x accum 2 trains like 8 GPUs" on your own machine, with the trainer you would run.

    ds-clip-demo                                    # 4 ranks x m=4  vs  2 ranks x m=4 x k=2, ZeRO-2
    ds-clip-demo --world-size 2 --accum-freq 4 --zero-stage 3 --precision bf16 --steps 6
    python -m ds_clip.demo ...                      # the same without the console script

Runs `ds-clip-train` twice under the `deepspeed` launcher on the same generated data: run A on W*k ranks
with micro-batch m (k=1), run B on W ranks with micro-batch m and --accum-freq k. Both use the trainer's
own defaults for what is random: open_clip's train transform (random crops, a function of seed, epoch
and sample), a ViT with patch dropout, DataLoader workers. Prints both loss curves (metrics.csv, every
step) and the largest difference of the exported weights. On a CPU machine the launcher starts CPU ranks;
on a GPU node it needs W*k GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEMO_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {
        "image_size": 32,
        "layers": 2,
        "width": 64,
        "patch_size": 8,
        "head_width": 32,
        "patch_dropout": 0.25,
    },
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
LR = 3e-3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-clip-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="W: ranks of the accumulating run (default 2)")
    p.add_argument("--accum-freq", type=int, default=2, help="k: micro-batches per step (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="m: pairs per micro-batch per rank (default 4)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--zero-stage", type=int, default=2, choices=range(4), help="ZeRO stage (default 2)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="(default fp32)")
    p.add_argument("--siglip", action="store_true", help="SigLIP loss with a learnable bias")
    p.add_argument("--local-loss", action="store_true", help="local loss + gather-with-grad")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (default 1)")
    p.add_argument("--keep", metavar="DIR", help="keep both run folders in DIR (default: a temporary folder)")
    return p


def _launcher() -> list[str]:
    found = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def _train(ranks: int, argv: list[str], log: Path) -> None:
    cmd = [*_launcher(), "--num_gpus", str(ranks), "--module", "ds_clip.train", *argv]
    print("  $", " ".join(cmd[:6]), "...", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(
            f"ds-clip-demo: error: the run failed (exit {done.returncode}); its log {log}:\n{tail}"
        )


def _losses(run_dir: Path) -> list[float]:
    return [float(r["loss"]) for r in csv.DictReader((run_dir / "metrics.csv").open())]


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    for flag, v in (
        ("--world-size", a.world_size),
        ("--accum-freq", a.accum_freq),
        ("--batch-size", a.batch_size),
        ("--steps", a.steps),
    ):
        if v < 1:
            print(f"ds-clip-demo: error: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    if a.workers < 0:
        print(f"ds-clip-demo: error: --workers must be >= 0, got {a.workers}", file=sys.stderr)
        return 2
    if a.keep:  # its run folders A and B: a second demo into the same folder would be refused by the trainer
        from ds_clip.checkpoint import RunFolderError, check_fresh_run_folder

        try:
            for name in ("A", "B"):
                check_fresh_run_folder(Path(a.keep) / name, name)
        except RunFolderError:
            print(
                f"ds-clip-demo: error: --keep {a.keep} holds the run folders of an earlier demo (A, B with "
                "checkpoints); give another folder",
                file=sys.stderr,
            )
            return 2
    from ds_clip.export.openclip import consolidated_state_dict
    from ds_clip.geometry import BatchGeometry

    # Run B accumulates k micro-batches on W ranks; run A trains the same N pairs per step on W*k ranks at k=1.
    geometry_b = BatchGeometry(a.world_size, a.accum_freq, a.batch_size)
    geometry_a = BatchGeometry(geometry_b.world_size * geometry_b.accum_freq, 1, geometry_b.micro_batch_size)
    w, k, m = geometry_b.world_size, geometry_b.accum_freq, geometry_b.micro_batch_size
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="ds-clip-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    model_dir.mkdir(exist_ok=True)
    cfg = dict(DEMO_MODEL, **({"init_logit_bias": -10.0} if a.siglip else {}))
    (model_dir / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    common = [
        "--model", f"local-dir:{model_dir}", "--batch-size", str(m), "--max-steps", str(a.steps),
        "--zero-stage", str(a.zero_stage), "--precision", a.precision, "--lr", str(LR), "--eps", "1e-6",
        "--warmup", "1", "--log-every-n-steps", "1", "--report-to", "csv", "--workers", str(a.workers),
        "--train-num-samples", str(geometry_b.global_batch * a.steps), "--logs", str(root),
        *(["--siglip"] if a.siglip else []), *(["--local-loss", "--gather-with-grad"] if a.local_loss else []),
    ]  # fmt: skip
    print(
        f"global batch N = {geometry_b.global_batch} pairs per step, ZeRO-{a.zero_stage}, {a.precision}, "
        f"random crops and patch dropout on, --workers {a.workers}; run folders in {root}"
    )
    print(f"run A: {geometry_a.world_size} ranks x m={m} (k=1)", flush=True)
    _train(geometry_a.world_size, [*common, "--accum-freq", "1", "--name", "A"], root / "A.log")
    print(f"run B: {w} ranks x m={m} x k={k} (cached accumulation)", flush=True)
    _train(w, [*common, "--accum-freq", str(k), "--name", "B"], root / "B.log")

    loss_a, loss_b = _losses(root / "A"), _losses(root / "B")
    w_a = geometry_a.world_size
    print(f"\n{'step':>4}  {f'loss A ({w_a}x{m})':>18}  {f'loss B ({w}x{m}x{k})':>18}  {'|A-B|':>9}")
    for i, (la, lb) in enumerate(zip(loss_a, loss_b), start=1):
        print(f"{i:>4}  {la:>18.6f}  {lb:>18.6f}  {abs(la - lb):>9.2e}")
    tag = f"step_{a.steps:08d}"
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # DeepSpeed's loading prints
        wa = consolidated_state_dict(root / "A" / "checkpoints" / tag)
        wb = consolidated_state_dict(root / "B" / "checkpoints" / tag)
    worst_name, worst = max(
        ((n, float((p.float() - wb[n].float()).abs().max())) for n, p in wa.items()), key=lambda t: t[1]
    )
    print(
        f"\nlargest difference of the exported weights after {a.steps} steps: {worst:.3e} ({worst_name}), "
        f"{worst / LR:.1%} of one AdamW step (lr {LR:g})"
    )
    # fp32 runs agree to float rounding, which AdamW amplifies where a true gradient is 0 (attention
    # key biases); bf16 adds its own rounding. 10% (fp32) / 100% (bf16) of one step is the verdict line.
    tol = 0.1 * LR if a.precision == "fp32" else LR
    same = worst <= tol and len(loss_a) == len(loss_b) == a.steps
    print("verdict:", "SAME TRAINING (within float rounding)" if same else f"DIFFERENT (tolerance {tol:g})")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
