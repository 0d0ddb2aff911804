"""ds-clip-train next to open_clip_train as users run them: each trainer's own command line, default flags,
synthetic data, and the seconds per optimizer step that each trainer's own per-step log prints.

    python benchmarks/side_by_side.py --k 1 8 --json benchmarks/results/raw/side_by_side_vitb32.json -- \\
        --model ViT-B-32 --force-image-size 64 --batch-size 4
    python benchmarks/side_by_side.py --k 1 8 -- --model ds-clip-tiny --batch-size 16
    python benchmarks/side_by_side.py --ranks 2 --k 8 -- --model ViT-B-32 --force-image-size 64 --batch-size 4
    python benchmarks/side_by_side.py --ds-clip-flags="--zero-stage 0" -- ...   # extra flags, ds_clip only

Everything after ``--`` goes to both trainers unchanged; the script adds --accum-freq, the step count and the
logging each needs (ds_clip: --max-steps, --log-every-n-steps 1; open_clip: --dataset-type synthetic,
--train-num-samples for exactly that many steps, --epochs 1, --log-every-n-steps 1, no saving or eval,
--device cpu on a CPU machine, and --precision fp32, ds_clip's default, unless the flags set one). One process: ``python -m ds_clip.train`` and ``python -m open_clip_train.main``;
``--ranks R``: ``deepspeed --num_gpus R --module ds_clip.train`` and ``torchrun --nproc_per_node R`` of
open_clip's main (gloo on the CPU). open_clip's side is ``open_clip_train.main.main(argv)`` called from this
file (``--open-clip``), which first registers ds_clip's model configs with open_clip (so both build
``ds-clip-tiny`` by name) and, on the CPU only, makes DistributedDataParallel take ``device_ids=None``:
open_clip_train 3.3.0 passes ``device_ids=[device]``, which torch refuses for a CPU module (its only
obstacle to multi-rank CPU training here); nothing else changes.

Per-step time, from each trainer's own log line: ds_clip's ``data`` + ``step`` seconds (the loop iteration),
open_clip's ``Batch (t)`` (the loop iteration, data included; a per-step value with --log-every-n-steps 1).
Medians of steps 2..S (step 1 pays one-time costs); also without the data wait each log reports (ds_clip's
``data``, open_clip's ``Data (t)``), since the two loaders differ (default workers 1 vs 4; ds_clip's
synthetic pairs are drawn shapes, open_clip's one blank image). The two trainers alternate, which one goes first
alternates between repeats, and ``uptime``'s 1-minute load is recorded before each run: on a shared machine
only ratios of neighbouring runs mean much. A ds_clip run is stopped after its last step line (its final
checkpoint is not part of a step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_DS_STEP = re.compile(r"^step (\d+)/(\d+) \|.*\| data ([0-9.]+)s \| step ([0-9.]+)s")
_OC_STEP = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+ .*Data \(t\): ([0-9.]+) Batch \(t\): ([0-9.]+)")


def _value(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def ds_clip_command(
    user: list[str], extra: list[str], k: int, steps: int, ranks: int, logs: str
) -> list[str]:
    if ranks == 1:
        launcher = [sys.executable, "-m", "ds_clip.train"]
    else:
        from ds_clip.distributed import _free_port

        # a free port, not the launcher's default 29500 (another job on the machine may hold it)
        launcher = [
            "deepspeed",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(_free_port()),
            "--module",
            "ds_clip.train",
        ]
    own = ["--accum-freq", str(k), "--max-steps", str(steps), "--log-every-n-steps", "1", "--logs", logs]
    return [*launcher, *user, *extra, *own]


def open_clip_command(user: list[str], k: int, steps: int, ranks: int, logs: str) -> list[str]:
    batch = int(_value(user, "--batch-size", "64"))
    own = [
        "--accum-freq", str(k), "--dataset-type", "synthetic", "--train-num-samples", str(batch * k * ranks * steps),
        "--epochs", "1", "--logs", logs, "--log-every-n-steps", "1", "--save-frequency", "0",
        "--zeroshot-frequency", "0", "--val-frequency", "0",
    ]  # fmt: skip
    if "--precision" not in user:
        # ds-clip-train's default precision is fp32; open_clip_train's is "amp" (fp16 autocast, which on a CPU
        # without fp16 kernels costs many times an fp32 step): compare the same arithmetic.
        own += ["--precision", "fp32"]
    if not _cuda():
        own += ["--device", "cpu"]
    entry = [os.path.abspath(__file__), "--open-clip", "--"]
    if ranks == 1:
        return [sys.executable, *entry, *user, *own]
    return ["torchrun", "--standalone", "--nproc_per_node", str(ranks), *entry, *user, *own]


def parse_steps(trainer: str, text: str) -> dict[int, tuple[float, float]]:
    """Step number -> (seconds of that loop iteration, of it the seconds spent waiting for data), from the
    trainer's own log lines (ds_clip: data + step; open_clip: Batch (t), which includes its Data (t))."""
    out: dict[int, tuple[float, float]] = {}
    for line in text.splitlines():
        if trainer == "ds_clip":
            m = _DS_STEP.search(line)
            if m:
                out[int(m.group(1))] = (float(m.group(3)) + float(m.group(4)), float(m.group(3)))
        else:
            m = _OC_STEP.search(line)
            if m:
                out[len(out) + 1] = (float(m.group(3)), float(m.group(2)))
    return out


def load1() -> float:
    return os.getloadavg()[0]


def run_one(trainer: str, cmd: list[str], steps: int, timeout_s: float) -> dict:
    """Run one trainer to its last step line; its per-step seconds and the load around it."""
    before = load1()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if time.perf_counter() - t0 > timeout_s:
                break
            if trainer == "ds_clip" and (m := _DS_STEP.search(line)) and int(m.group(1)) == steps:
                break  # the last step is logged; the final checkpoint is not part of a step
    finally:
        _end_group(proc)
    text = "".join(lines)
    per_step = parse_steps(trainer, text)
    if len(per_step) < steps:
        tail = "".join(lines[-30:])
        raise SystemExit(
            f"{trainer}: {len(per_step)} of {steps} step lines (exit {proc.returncode}):\n{tail}"
        )
    timed = range(2, steps + 1)
    return {
        "trainer": trainer,
        "cmd": shlex.join(cmd),
        "steps_s": [per_step[i][0] for i in range(1, steps + 1)],
        "data_s": [per_step[i][1] for i in range(1, steps + 1)],
        "median_s": statistics.median(per_step[i][0] for i in timed),
        # the loop iteration without the wait for data (the loaders differ: worker count, synthetic images)
        "median_compute_s": statistics.median(per_step[i][0] - per_step[i][1] for i in timed),
        "load1_before": before,
        "load1_after": load1(),
    }


def _end_group(proc: subprocess.Popen) -> None:
    """Stop this run's own process group (launcher and ranks) and wait until none of it is left, so the next
    run starts on a quiet machine and the log folder can be removed (SIGKILL after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        proc.poll()  # reap the launcher once it exits (a zombie would stay in the group)
        try:
            os.killpg(proc.pid, signal.SIGKILL if time.monotonic() > deadline else signal.SIGTERM)
        except ProcessLookupError:
            break  # nothing of the group is left
        time.sleep(0.5)
    proc.wait()


def open_clip_entry(argv: list[str]) -> int:
    """open_clip_train's main(argv), with ds_clip's model configs (ds-clip-tiny) registered with open_clip,
    and on the CPU, DDP given device_ids=None for the CPU module."""
    patch_cpu_ddp()
    from open_clip_train.main import main as open_clip_main

    open_clip_main(argv)
    return 0


def patch_cpu_ddp() -> None:
    """Register ds_clip's model configs with open_clip and make DistributedDataParallel take device_ids=None for
    a CPU module (open_clip_train passes device_ids=[cpu], which torch refuses); nothing else changes."""
    import torch

    import ds_clip.models.model  # noqa: F401  (registers ds_clip's built-in model configs with open_clip)

    ddp = torch.nn.parallel.DistributedDataParallel

    class CpuDDP(ddp):  # type: ignore[misc, valid-type]
        def __init__(self, module, device_ids=None, *args, **kwargs):
            if device_ids is not None and all(torch.device(d).type == "cpu" for d in device_ids):
                device_ids = None
            super().__init__(module, device_ids, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CpuDDP  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    user = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    if own[:1] == ["--open-clip"]:
        return open_clip_entry(user)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, nargs="+", default=[1, 8], help="--accum-freq values")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (medians of 2..steps)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ds-clip-flags", default="", help="extra flags for ds-clip-train only (one string)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--json", type=Path, help="append the runs to this JSON file")
    args = p.parse_args(own)
    extra = shlex.split(args.ds_clip_flags)
    runs = []
    for rep in range(args.repeats):
        for k in args.k:
            order = ("ds_clip", "open_clip") if (rep + args.k.index(k)) % 2 == 0 else ("open_clip", "ds_clip")
            for trainer in order:
                with tempfile.TemporaryDirectory(prefix="side_by_side_") as logs:
                    if trainer == "ds_clip":
                        cmd = ds_clip_command(user, extra, k, args.steps, args.ranks, logs)
                    else:
                        cmd = open_clip_command(user, k, args.steps, args.ranks, logs)
                    r = run_one(trainer, cmd, args.steps, args.timeout)
                r.update(k=k, rep=rep, ranks=args.ranks, argv=user, ds_clip_flags=extra)
                runs.append(r)
                print(
                    f"[side_by_side] k={k} rep={rep} {trainer}: median {r['median_s']:.2f} s/step, "
                    f"{r['median_compute_s']:.2f} without data wait "
                    f"(load {r['load1_before']:.1f} -> {r['load1_after']:.1f}) "
                    f"steps {' '.join(f'{s:.2f}' for s in r['steps_s'])}",
                    flush=True,
                )
    print(
        "\n| k | ranks | ds-clip-train s/step | open_clip_train s/step | ratio | ratio without data wait | "
        "load (1 min) |"
    )
    print("|---|---|---|---|---|---|---|")
    for rep in range(args.repeats):
        for k in args.k:
            ours = next(r for r in runs if r["k"] == k and r["rep"] == rep and r["trainer"] == "ds_clip")
            theirs = next(r for r in runs if r["k"] == k and r["rep"] == rep and r["trainer"] == "open_clip")
            loads = [ours["load1_before"], theirs["load1_before"]]
            print(
                f"| {k} | {args.ranks} | {ours['median_s']:.2f} | {theirs['median_s']:.2f} | "
                f"{ours['median_s'] / theirs['median_s']:.2f} | "
                f"{ours['median_compute_s'] / theirs['median_compute_s']:.2f} | {min(loads):.1f}-{max(loads):.1f} |"
            )
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else {"runs": []}
        old["runs"] += runs
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(old, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
