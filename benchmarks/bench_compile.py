"""What --torchcompile buys: time per optimizer step of ``ds-clip-train`` with and without it.

Run from the repository root with ds_clip installed (scripts/setup.sh):

    python benchmarks/bench_compile.py                                   # ds-clip-tiny, m=16, k=2, ~2 min
    python benchmarks/bench_compile.py --model ViT-B-32 --batch-size 4 --steps 6 --json benchmarks/results/raw/x.json
    python benchmarks/bench_compile.py --extra=--precision --extra=bf16 --zero-stage 2   # any train flag

How it measures, and why that way:

* The product, nothing else: each mode is one fresh ``ds-clip-train`` process (one rank, synthetic data,
  ``--log-every-n-steps 1 --report-to csv``), the same flags but ``--torchcompile``. Times are the run's own
  ``metrics.csv`` rows: ``step_time_s`` (the cached step, from the first forward to ``engine.step``) and
  ``samples_per_s`` (k·m·W pairs per wall second of the logging window, data included).
* Step 1 is reported apart: with --torchcompile it holds the compile (dynamo traces the forward once per
  grad mode, inductor generates and builds the kernels). Steady state is steps 2..N: median, mean, standard
  deviation, min and max, so the spread on a shared machine is visible.
* Inductor's on-disk cache would turn a second compile into a cache read, so every compiled run gets a fresh,
  empty cache folder (``TORCHINDUCTOR_CACHE_DIR``): step 1 is the cold compile a first run pays. Pass
  ``--warm-cache`` to keep the default cache instead (what a rerun of the same model pays).
* The two modes alternate (eager, compiled, eager, compiled, ... for ``--repeats``), so drift in the
  machine's load hits both. Wall time; a measurement, not a test.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/bench_compile.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ds-clip-tiny", help="--model of ds-clip-train")
    p.add_argument("--batch-size", type=_positive, default=16, help="m, pairs per micro-batch")
    p.add_argument("--accum-freq", type=_positive, default=2, help="k, micro-batches per step")
    p.add_argument("--steps", type=_positive, default=8, help="optimizer steps per run (>= 2)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=0)
    p.add_argument("--repeats", type=_positive, default=1, help="runs per mode, alternating")
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's default on-disk cache")
    p.add_argument("--extra", action="append", default=[], help="one more ds-clip-train word (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="add the measurements to this JSON file")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 is the compile; steady state needs more)")
    return args


def train_command(args: argparse.Namespace, logs: Path, name: str, compiled: bool) -> list[str]:
    exe = shutil.which("ds-clip-train") or "ds-clip-train"
    cmd = [exe, "--model", args.model, "--batch-size", str(args.batch_size), "--accum-freq",
           str(args.accum_freq), "--max-steps", str(args.steps), "--zero-stage", str(args.zero_stage),
           "--workers", "0", "--log-every-n-steps", "1", "--report-to", "csv", "--logs", str(logs),
           "--name", name, "--warmup", "0", *args.extra]  # fmt: skip
    return cmd + (["--torchcompile"] if compiled else [])


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def run_once(args: argparse.Namespace, work: Path, name: str, compiled: bool) -> dict[str, Any]:
    """One ds-clip-train process; its per-step rows from metrics.csv."""
    env = dict(os.environ)
    if compiled and not args.warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{name}")
    cmd = train_command(args, work / "logs", name, compiled)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"benchmarks/bench_compile.py: {' '.join(cmd)} exited {proc.returncode}")
    with (work / "logs" / name / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = [float(r["step_time_s"]) for r in rows]
    rates = [float(r["samples_per_s"]) for r in rows]
    return {
        "compiled": compiled,
        "process_wall_s": round(wall, 2),
        "step_time_s": steps,
        "samples_per_s": rates,
        "first_step_s": steps[0],
        "steady_step_s": _stats(steps[1:]),
        "steady_samples_per_s": _stats(rates[1:]),
    }


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg": list(os.getloadavg()),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    try:
        cpu = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        info["cpu"] = cpu[0].split(":", 1)[1].strip() if cpu else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    return info


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        mine = [r for r in runs if r["compiled"] is compiled]
        steady = [t for r in mine for t in r["step_time_s"][1:]]
        out[mode] = {
            "first_step_s": [r["first_step_s"] for r in mine],
            "steady_step_s": _stats(steady),
            "steady_samples_per_s": _stats([v for r in mine for v in r["samples_per_s"][1:]]),
            "process_wall_s": [r["process_wall_s"] for r in mine],
        }
    out["steady_speedup"] = (
        out["eager"]["steady_step_s"]["median"] / out["compiled"]["steady_step_s"]["median"]
    )
    out["compile_overhead_s"] = statistics.median(out["compiled"]["first_step_s"]) - statistics.median(
        out["eager"]["first_step_s"]
    )
    return out


def markdown(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    head = "| model | m | k | mode | step 1 (s) | steady s/step median (min-max, sd) | samples/s median |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for mode in ("eager", "compiled"):
        s = summary[mode]
        st = s["steady_step_s"]
        first = ", ".join(f"{v:.2f}" for v in s["first_step_s"])
        lines.append(
            f"| {args.model} | {args.batch_size} | {args.accum_freq} | {mode} | {first} | "
            f"{st['median']:.3f} ({st['min']:.3f}-{st['max']:.3f}, {st['stdev']:.3f}) | "
            f"{s['steady_samples_per_s']['median']:.1f} |"
        )
    lines.append(
        f"\nsteady-state speed-up (eager median / compiled median): {summary['steady_speedup']:.2f}x; "
        f"compile overhead in step 1: {summary['compile_overhead_s']:.1f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    start = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.repeats):
            for compiled in (False, True):
                name = f"{'compiled' if compiled else 'eager'}-{i}"
                print(f"running {name} ...", file=sys.stderr, flush=True)
                runs.append(run_once(args, work, name, compiled))
    info["loadavg_end"] = list(os.getloadavg())
    info["wall_s"] = round(time.perf_counter() - start, 1)
    summary = summarize(runs)
    table = markdown(args, summary)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": info,
            "argv": sys.argv[1:] if argv is None else argv,
            "command": ["ds-clip-train", *train_command(args, Path("LOGS"), "NAME", True)[1:]],
            "cold_cache": not args.warm_cache,
            "summary": summary,
            "runs": runs,
            "table": table,
        }
        # One file holds several configurations, keyed by model, m, k and stage (a rerun replaces its own).
        label = f"{args.model}-m{args.batch_size}-k{args.accum_freq}-z{args.zero_stage}"
        label += "-warm-cache" if args.warm_cache else "-cold-cache"
        saved = json.loads(args.json.read_text()) if args.json.exists() else {}
        saved[label] = record
        args.json.write_text(json.dumps(saved, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
