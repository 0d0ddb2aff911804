"""Where one optimizer step's time goes: a torch.profiler table of the top operators, for ds_clip's trainer
and open_clip's, run as users run them (their own entry points, their own defaults unless flags say other).

    python benchmarks/profile_step.py ds_clip -- --model ViT-B-32 --force-image-size 64 --batch-size 4
    python benchmarks/profile_step.py ds_clip -- --model ViT-B-32 --force-image-size 64 --batch-size 4 --zero-stage 0
    python benchmarks/profile_step.py open_clip -- --model ViT-B-32 --force-image-size 64 --batch-size 4
    python benchmarks/profile_step.py ds_clip --json out.json --row-limit 25 -- ...   # also save the rows

Everything after ``--`` goes to the trainer unchanged, plus what both need to run a short synthetic job here
(ds_clip: --max-steps, --logs; open_clip: --dataset-type synthetic, --train-num-samples, --epochs 1,
--device cpu on a CPU machine, --logs, and --precision fp32, ds_clip's default, unless the flags set one). One process, one thread (``--threads``).

Several ranks (``--ranks R``): the script starts itself under the launcher users run, ``deepspeed --num_gpus R``
for ds_clip and ``torchrun --standalone --nproc_per_node R`` for open_clip (its DDP given ``device_ids=None`` on
CPU ranks, as in side_by_side.py); every rank profiles its own step and rank 0 prints and saves its table:

    python benchmarks/profile_step.py ds_clip --ranks 2 --json p.json -- --model ds-clip-tiny --batch-size 16
    python benchmarks/profile_step.py open_clip --ranks 2 -- --model ds-clip-tiny --batch-size 16

Besides the operator table, the step's self CPU time is split into groups by operator name (``GROUPS``):
matrix multiplies (forward and backward), the optimizer's update, copies (flattening gradients into ZeRO
partitions, copying parameters back, casts, concatenations), collectives (gloo/NCCL calls, including the time
a rank waits in them for the other ranks) and the rest (element-wise ops, attention, norms, autograd). Shares of
one step survive a loaded machine better than seconds do; "outside operators" is the self time of the
profiler's step span (Python, the loop, and time descheduled when other jobs share the cores).

How a "step" is cut out of a trainer that owns its loop: the end of every optimizer step (open_clip: a global
optimizer-step post-hook, ``torch.optim.optimizer.register_optimizer_step_post_hook``; ds_clip: the end of
``DeepSpeedEngine.step``, since ZeRO 1-3 call the torch optimizer once per parameter group) advances the
profiler's schedule, so the active window is exactly one optimizer period (from the end of one optimizer step to the end of the next:
forward/backward passes, gradient bookkeeping, the optimizer), after ``--skip`` untimed periods that pay the
one-time costs. The table is torch.profiler's ``key_averages()`` sorted by self CPU time (CUDA time on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Operator-name groups of one step, tried in this order; an operator matching none is "rest". Names are torch's
# (aten::..., c10d::...) and gloo's record names; DeepSpeed's flatten is aten::cat, its copy-back aten::copy_.
GROUPS: dict[str, tuple[str, ...]] = {
    # the profiler's own step span: its self time is what no operator covers (Python, the loop, the data
    # loader's hand-over, time descheduled on a loaded machine)
    "outside operators": ("profilerstep",),
    "collectives": ("c10d::", "gloo:", "nccl:", "allreduce", "all_reduce", "allgather", "all_gather", "broadcast",
                    "reduce_scatter", "barrier", "record_param_comms", "wait"),
    "optimizer": ("adam", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt", "aten::_foreach"),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product",
               "aten::convolution", "aten::mkldnn_convolution"),
    "copies": ("aten::copy_", "aten::cat", "aten::_to_copy", "aten::clone", "aten::narrow_copy", "aten::zero_",
               "aten::fill_", "aten::index_put", "aten::_unsafe_view", "aten::contiguous"),
}  # fmt: skip


def group_of(op: str) -> str:
    """The GROUPS key of an operator name (case-insensitive substring match), else "rest"."""
    name = op.lower()
    for group, needles in GROUPS.items():
        if any(n in name for n in needles):
            return group
    return "rest"


def _launcher_argv(trainer: str, ranks: int, own: list[str], user: list[str]) -> list[str]:
    """This script under the launcher a user runs: deepspeed for ds_clip, torchrun for open_clip."""
    script = [os.path.abspath(__file__), *own, "--rank-child", "--", *user]
    if trainer == "ds_clip":
        from ds_clip.distributed import _free_port

        # a free port, not the launcher's default 29500 (another job on the machine may hold it)
        return ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(_free_port()), *script]
    return ["torchrun", "--standalone", "--nproc_per_node", str(ranks), *script]


def _trainer_argv(trainer: str, user: list[str], steps: int, logs: str) -> list[str]:
    if trainer == "ds_clip":
        return [*user, "--max-steps", str(steps), "--logs", logs, "--log-every-n-steps", "1"]
    import torch

    batch = _value(user, "--batch-size", "64")
    k = _value(user, "--accum-freq", "1")
    extra = [
        "--dataset-type", "synthetic", "--train-num-samples", str(int(batch) * int(k) * steps),
        "--epochs", "1", "--logs", logs, "--log-every-n-steps", "1", "--save-frequency", "0",
        "--zeroshot-frequency", "0", "--val-frequency", "0",
    ]  # fmt: skip
    if "--precision" not in user:
        # ds-clip-train's default precision is fp32; open_clip_train's is "amp" (fp16 autocast, which on a CPU
        # without fp16 kernels costs many times an fp32 step): compare the same arithmetic.
        extra += ["--precision", "fp32"]
    if not torch.cuda.is_available():
        extra += ["--device", "cpu"]
    return [*user, *extra]


def _value(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def _step_boundary(trainer: str, on_step):
    """Call ``on_step`` at the end of every optimizer step; returns the undo.

    open_clip: torch's global optimizer-step post-hook (its AdamW steps once per optimizer step). ds_clip: the
    end of ``DeepSpeedEngine.step``, because ZeRO 1-3 call the torch optimizer once per parameter group (the
    global hook would then cut the window between the two groups' updates, leaving the decay group's AdamW
    and the parameter copy-back out of the table).
    """
    if trainer != "ds_clip":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        return register_optimizer_step_post_hook(lambda *_: on_step()).remove
    from deepspeed.runtime.engine import DeepSpeedEngine

    inner = DeepSpeedEngine.step

    def step(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        on_step()
        return out

    DeepSpeedEngine.step = step

    def undo() -> None:
        DeepSpeedEngine.step = inner

    return undo


def profile(trainer: str, user_argv: list[str], *, skip: int, threads: int, row_limit: int):
    """Run the trainer for skip + 1 optimizer steps (+1 to close the window) and profile one of them."""
    import torch
    from torch.profiler import ProfilerActivity, schedule

    torch.set_num_threads(threads)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = torch.profiler.profile(
        activities=activities,
        schedule=schedule(wait=skip - 1, warmup=1, active=1, repeat=1),
        record_shapes=False,
    )
    remove_hook = _step_boundary(trainer, prof.step)
    logs = tempfile.mkdtemp(prefix="ds_clip_profile_")
    argv = _trainer_argv(trainer, user_argv, skip + 2, logs)
    prof.start()
    try:
        if trainer == "ds_clip":
            from ds_clip.train import main

            rc = main(argv)
        else:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
                from side_by_side import patch_cpu_ddp

                patch_cpu_ddp()
            from open_clip_train.main import main

            rc = main(argv)
    finally:
        prof.stop()
        remove_hook()
        # ds-clip-train's final checkpoint of ViT-B-32 is 2.3 GB: nothing of the run folder is kept.
        shutil.rmtree(logs, ignore_errors=True)
    if rc not in (None, 0):
        raise SystemExit(f"{trainer} exited with {rc}")
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort, row_limit=row_limit)
    total_us = sum(e.self_cpu_time_total for e in averages)
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:row_limit]
    groups: dict[str, float] = dict.fromkeys([*GROUPS, "rest"], 0.0)
    for e in averages:
        groups[group_of(e.key)] += e.self_cpu_time_total
    data = {
        "trainer": trainer,
        "argv": user_argv,
        "threads": threads,
        "ranks": int(os.environ.get("WORLD_SIZE", "1")),
        "load1": os.getloadavg()[0],
        "step_self_cpu_s": total_us / 1e6,
        "shares": {g: (us / total_us if total_us else 0.0) for g, us in groups.items()},
        "top": [
            {
                "op": e.key,
                "calls": e.count,
                "self_cpu_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / total_us if total_us else 0.0,
            }
            for e in rows
        ],
    }
    return table, data


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    user = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trainer", choices=("ds_clip", "open_clip"))
    p.add_argument("--skip", type=int, default=2, help="untimed optimizer steps before the profiled one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--row-limit", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the top rows as JSON here")
    p.add_argument("--ranks", type=int, default=1, help="ranks, started by deepspeed (ds_clip) or torchrun")
    p.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    # deepspeed's launcher puts --local_rank=N before the script's own flags (and LOCAL_RANK in the environment,
    # which ds-clip-train reads).
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(own)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.ranks > 1 and not args.rank_child:
        import subprocess

        return subprocess.call(_launcher_argv(args.trainer, args.ranks, own, user))
    table, data = profile(args.trainer, user, skip=args.skip, threads=args.threads, row_limit=args.row_limit)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    shares = ", ".join(f"{g} {v:.0%}" for g, v in data["shares"].items())
    print(
        f"\n=== {args.trainer} {' '.join(user)}: one optimizer step, {data['step_self_cpu_s']:.3f} s self CPU"
        f" (rank 0 of {data['ranks']}, load {data['load1']:.1f}): {shares}"
    )
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
