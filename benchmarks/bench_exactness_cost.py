"""The price of exactness: ds_clip's cached step against DeepSpeed's own gradient accumulation, same k and m.

Run from the repository root (about 8 minutes on 2 quiet CPU cores for ViT-B-32 at 64 px):

    python benchmarks/bench_exactness_cost.py --model ViT-B-32 --image-size 64 --batch-size 4 \\
        --k 2 4 8 --world-sizes 1 2 --steps 5 --json benchmarks/results/raw/quiet_exactness_cost.json

Quick look: ``python benchmarks/bench_exactness_cost.py --model ds-clip-tiny --k 2 --world-sizes 1 --steps 1``

Both sides train k micro-batches of m pairs per rank and take one optimizer step:

* **cached**: ``ds_clip.step.cached_step`` on the engine ``ds-clip-train`` builds (its default preset for W),
  whose loss sees all N = W·k·m pairs: a no-grad forward of every micro-batch, the loss once, then micro-batch
  0's kept graph and k − 1 recomputed forwards, each with its backward.
* **plain**: the same preset, optimizer and model under DeepSpeed's own ``gradient_accumulation_steps = k``
  (its managed accumulation, ``engine.set_train_batch_size(k·m·W)``): per micro-batch a forward, open_clip's
  ``ClipLoss`` over the m·W pairs of that micro-batch (so its negatives are m·W, not N), ``engine.backward``
  and ``engine.step()`` (which updates at the k-th). This is what a user gets without ds_clip's step.

Encoder work per step, with a backward costing two forwards: plain 3k forward-equivalents, cached 4k − 1 (the
no-grad pass of micro-batch 0 is kept with its graph, so it is not recomputed). The optimizer step, paid once by
both, only lowers the ratio; so the measured ratio should stay at or under (4k − 1) / (3k) (1.17 at k = 2,
1.25 at k = 4, 1.29 at k = 8). The loss over N instead of k losses over m·W adds N² − k·(m·W)² logits, which is
small at these m and reported as part of the ratio, not subtracted.

Method: both engines live in the same processes (gloo ranks started by ``ds_clip_harness.groups``), built from
the same seed, and their steps alternate (cached then plain, then plain then cached, ...), so each ratio compares
steps taken seconds apart on a machine whose load drifts. Each k gets its own process group: with every k in
one group, the cached k = 2 step that followed a plain k = 4 or 8 step took 1.5 s longer in some rounds than
the same step alone (3.9 against 2.35 s, ViT-B-32 at 64 px, one process; the cause was not pinned down), which
is not what a run of one k meets. The first ``--warmup`` rounds (1 unless given) are not timed. Time per step is the
largest over ranks (a step is as slow as its slowest rank); medians over ``--steps`` rounds. The ratio is the
median of the rounds' own ratios (each round's cached step over the plain step taken right beside it), not the
ratio of the two medians: on a virtual machine the same step varies by +-10 % from round to round, and a ratio of
medians drawn from different rounds moved by up to 0.1 between two runs of the same command. Each step's CPU
time (user + system of the process, the largest over ranks) is kept beside its wall time, and ``ratio_cpu`` is the
same median over it: where the two agree, the spread between rounds is the work itself, not time the machine
gave to something else.

Where the time goes (``--phases``): one more step of each side under torch.profiler, split by the cached step's
own ranges (``ds_clip.step.embed``: the k forwards, micro-batch 0's with its graph; ``.loss``; ``.push_back``:
k backwards and k - 1 recomputed forwards; ``.optimizer``) and the plain loop's (``plain.forward``,
``plain.loss_backward``, ``plain.optimizer``). The push-back should cost one plain backward plus k - 1 plain
forward-and-backward pairs; anything above that is overhead of the step's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness and the other benchmarks must import
    sys.path.insert(0, str(REPO_ROOT))


@dataclass
class CostSettings:
    model: str = "ViT-B-32"
    image_size: int | None = 64
    micro_batch_size: int = 4
    accum_freqs: list[int] = field(default_factory=lambda: [2, 4, 8])
    world_sizes: list[int] = field(default_factory=lambda: [1, 2])
    steps: int = 3
    """Timed rounds (each round: one cached and one plain step at every k)."""
    warmup: int = 1
    """Untimed rounds first. On a CPU the cached step's allocations settle over its first two steps (its second
    still faulted 87 thousand pages against 24 thousand after, ViT-B-32 at 64 px, k = 2): --warmup 2 times only
    the steady state a run lives in."""
    precision: str = "fp32"
    threads: int = 1
    seed: int = 0
    phases: bool = False
    """After the timed rounds, one more step of each side under torch.profiler: time per phase."""


def bound(k: int) -> float:
    """(4k − 1) / (3k): encoder forward-equivalents of the cached step over plain accumulation's."""
    return (4 * k - 1) / (3 * k)


def _group(s: CostSettings) -> list[dict]:
    """Every rank of one process group: both engines, all k, alternating; rank 0's rows are returned."""
    import open_clip
    import torch
    import torch.distributed as dist
    from torch.profiler import record_function

    from benchmarks.bench_accum import resolve_model
    from ds_clip.config import parse_settings
    from ds_clip.step.cached import input_dtype
    from ds_clip.training.engine import build_engine, build_model_bundle, resolve_run
    from ds_clip.training.wiring import build_step
    from ds_clip_harness.runs import FLAT_SCHEDULE_STEPS, generated_pairs

    torch.set_num_threads(s.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    name = resolve_model(s.model, s.image_size)
    m, ks = s.micro_batch_size, sorted(set(s.accum_freqs))
    flags = ["--model", name, "--batch-size", str(m), "--precision", s.precision, "--seed", str(s.seed)]
    flags += ["--lr", "1e-5", "--wd", "0.1", "--eps", "1e-6", "--warmup", "0", "--workers", "0"]
    settings = parse_settings(flags)
    geometry, ds = resolve_run(settings, world)

    # ds-clip-train's step (ds_clip.training.wiring), and beside it the same model (same seed: the same initial
    # weights) on DeepSpeed's own accumulation: the same JSON with its managed mode (ds_clip's step engine turns
    # it off).
    bundle = build_model_bundle(settings.model, seed=s.seed, loss=settings.loss)
    cached = build_step(settings, bundle, geometry, ds, rank=rank, total_steps=FLAT_SCHEDULE_STEPS)
    plain_json = ds.config
    plain_json["managed_gradient_accumulation"] = True
    plain = build_engine(
        build_model_bundle(settings.model, seed=s.seed), geometry,
        dataclasses.replace(ds, json_text=json.dumps(plain_json)), model=settings.model, optim=settings.optim,
        loss=settings.loss, seed=s.seed, rank=rank, total_steps=FLAT_SCHEDULE_STEPS,
    )  # fmt: skip
    plain_loss = open_clip.loss.ClipLoss(rank=rank, world_size=world)  # open_clip_train's default loss
    for built in (cached, plain):
        built.engine.train()

    cfg = bundle.model_cfg
    size = cfg["vision_cfg"]["image_size"]
    size = size if isinstance(size, int) else size[0]
    pool = [  # generated once, outside the timed region; distinct pairs on every rank
        generated_pairs(
            range((rank * max(ks) + j) * m, (rank * max(ks) + j + 1) * m),
            image_size=size,
            context_length=cfg["text_cfg"].get("context_length", 77),
            vocab_size=cfg["text_cfg"].get("vocab_size", 49408),
            seed=s.seed,
        )
        for j in range(max(ks))
    ]
    device = cached.engine.device
    dtype = input_dtype(cached.engine)
    pool = [(img.to(device, dtype), txt.to(device)) for img, txt in pool]
    cuda = str(device).startswith("cuda")

    def run_cached(k: int) -> None:
        cached.train(pool[:k])

    def run_plain(k: int) -> None:
        engine = plain.engine
        engine.set_train_batch_size(k * m * world)  # gradient_accumulation_steps = k
        for img, txt in pool[:k]:
            with record_function("plain.forward"):
                out = engine(image=img, text=txt)
            with record_function("plain.loss_backward"):
                loss = plain_loss(
                    out["image_features"].float(), out["text_features"].float(), out["logit_scale"].float()
                )
                engine.backward(loss)
            with record_function("plain.optimizer"):
                engine.step()  # DeepSpeed updates at the k-th call only

    def timed(fn, k: int) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process: user + system, every thread), each the largest over ranks."""
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        fn(k)
        if cuda:
            torch.cuda.synchronize()
        t = torch.tensor(
            [time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64, device=device
        )
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        wall, cpu = t.tolist()
        return wall, cpu

    times: dict[tuple[str, int], list[float]] = {}
    cpu_times: dict[tuple[str, int], list[float]] = {}
    sides = (("cached", run_cached), ("plain", run_plain))
    # The warm-up rounds come first (optimizer state, first allocations) and are not kept.
    for round_ in range(s.warmup + s.steps):
        for k in ks:
            for mode, fn in sides if round_ % 2 else sides[::-1]:  # who goes first alternates
                t, c = timed(fn, k)
                if round_ >= s.warmup:
                    times.setdefault((mode, k), []).append(t)
                    cpu_times.setdefault((mode, k), []).append(c)
    phases = {k: _phases(sides, k) for k in ks} if s.phases else {}
    stage = int(cached.engine.zero_optimization_stage())
    rows = []
    for k in ks:
        c, p = statistics.median(times[("cached", k)]), statistics.median(times[("plain", k)])
        paired = statistics.median(a / b for a, b in zip(times[("cached", k)], times[("plain", k)]))
        paired_cpu = statistics.median(
            a / b for a, b in zip(cpu_times[("cached", k)], cpu_times[("plain", k)])
        )
        rows.append(
            {
                "model": name, "W": world, "m": m, "k": k, "N": world * k * m, "zero": stage,
                "preset": ds.preset, "cached_s": c, "plain_s": p, "ratio": paired, "ratio_of_medians": c / p,
                "bound": bound(k),
                "cached_all_s": times[("cached", k)], "plain_all_s": times[("plain", k)],
                "ratio_cpu": paired_cpu,
                "cached_cpu_all_s": cpu_times[("cached", k)], "plain_cpu_all_s": cpu_times[("plain", k)],
                **({"phases_s": phases[k]} if phases else {}),
            }
        )  # fmt: skip
    for built in (cached, plain):
        built.engine.destroy()
    return rows


def _phases(sides, k: int) -> dict[str, float]:
    """One step of each side under torch.profiler: seconds in each named range (the cached step's own
    ``ds_clip.step.*`` ranges, the plain loop's ``plain.*``), and the forwards and backwards inside them."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, float] = {}
    for _, fn in sides:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(k)
        for event in prof.key_averages():
            if event.key.startswith(("ds_clip.step.", "plain.")):
                out[event.key] = event.cpu_time_total / 1e6
    return out


def machine() -> dict:
    import platform

    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def table(rows: list[dict]) -> str:
    out = [
        "| model | W | ZeRO (preset) | m | k | N | cached s/step | plain s/step | ratio | bound (4k−1)/(3k) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['W']} | {r['zero']} ({r['preset']}) | {r['m']} | {r['k']} | {r['N']} | "
            f"{r['cached_s']:.3f} | {r['plain_s']:.3f} | **{r['ratio']:.2f}** | {r['bound']:.2f} |"
        )
    phased = [r for r in rows if r.get("phases_s")]
    if phased:
        names = sorted({n for r in phased for n in r["phases_s"]})
        out += ["", "| W | k | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        for r in phased:
            cells = " | ".join(f"{r['phases_s'].get(n, 0.0):.3f}" for n in names)
            out.append(f"| {r['W']} | {r['k']} | {cells} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    d = CostSettings()
    p = argparse.ArgumentParser(prog="benchmarks/bench_exactness_cost.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=d.model, help="open_clip model name (ds-clip-tiny, ViT-B-32, ...)")
    p.add_argument("--image-size", type=int, default=d.image_size, help="image side in px (0: the model's)")
    p.add_argument(
        "--batch-size", type=int, default=d.micro_batch_size, help="m, pairs per micro-batch per rank"
    )
    p.add_argument("--k", type=int, nargs="+", default=d.accum_freqs, help="micro-batches per step")
    p.add_argument("--world-sizes", type=int, nargs="+", default=d.world_sizes, help="W, local gloo ranks")
    p.add_argument("--steps", type=int, default=d.steps, help="timed rounds after the warm-up rounds")
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help="untimed rounds first (2: the cached step settled)"
    )
    p.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument(
        "--phases", action="store_true", help="then one profiled step of each side: seconds per phase"
    )
    p.add_argument("--json", type=Path, default=None, help="write the rows and the machine here")
    a = p.parse_args(argv)
    for flag, values in (("--batch-size", [a.batch_size]), ("--k", a.k), ("--world-sizes", a.world_sizes),
                         ("--steps", [a.steps]), ("--warmup", [a.warmup]), ("--threads", [a.threads])):  # fmt: skip
        if min(values) < 1:
            p.error(f"{flag} must be >= 1")
    if a.json is not None and not a.json.parent.is_dir():
        p.error(f"--json: folder {a.json.parent} does not exist")
    s = CostSettings(
        model=a.model, image_size=a.image_size or None, micro_batch_size=a.batch_size, accum_freqs=a.k,
        world_sizes=a.world_sizes, steps=a.steps, warmup=a.warmup, precision=a.precision, threads=a.threads, phases=a.phases,
    )  # fmt: skip
    from ds_clip_harness.groups import spawn_group

    start, t0 = machine(), time.perf_counter()
    rows: list[dict] = []
    for w in s.world_sizes:
        for k in sorted(set(s.accum_freqs)):  # a fresh group per k: see the module docstring
            print(f"[exactness cost] W={w}: {s.model} m={s.micro_batch_size} k={k}", flush=True)
            rows += spawn_group(w, _group, dataclasses.replace(s, accum_freqs=[k]))
    info = {**start, "loadavg_end": list(os.getloadavg()), "wall_s": round(time.perf_counter() - t0, 1)}
    print(table(rows))
    print(f"\n{info['date']} | load {info['loadavg']} -> {info['loadavg_end']} | {info['wall_s']} s")
    if a.json is not None:
        a.json.write_text(json.dumps({"machine": info, "settings": asdict(s), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
