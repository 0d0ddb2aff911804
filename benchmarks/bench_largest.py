"""The largest global batch N that trains one optimizer step within a memory budget and a time cap per step.

Three ways to train one step of N = k·m pairs on one process, each found by doubling N at a fixed
micro-batch m (k = N/m), for CLIP and for SigLIP:

* ``open_clip``: open_clip's own trainer (``open_clip_train.main.main``) with ``--accum-freq k``. It
  recomputes the loss over all N pairs in each of its k passes (k × an N × N logit matrix per step).
* ``dense``: ``ds-clip-train --loss-impl dense``: the cached step, the N × N loss computed once.
* ``tiled``: ``ds-clip-train --loss-impl tiled``: the same step, the loss in blocks of
  ``--tile-size`` (memory linear in N).

Run from the repository root (the final measurement: about 2 hours on 2 CPU cores, on a machine with
at least 18 GiB of free memory; see docs/benchmarks.md):

    PYTHONPATH=. python benchmarks/bench_largest.py --json benchmarks/results/raw/largest_cpu.json \\
        --img docs/img/largest_batch.png

Quick look (a few minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_largest.py --memory-budget 3 --time-cap 30 --json largest.json

Re-render the table and the plot from saved JSON, running nothing:

    PYTHONPATH=. python benchmarks/bench_largest.py --report benchmarks/results/raw/largest_cpu.json \\
        --img docs/img/largest_batch.png

How it measures, and why that way:

* Every trial (method, loss, N) runs in a fresh process, so its peak memory is its own. The parent polls
  the memory of the trial's whole process tree (VmRSS of the trainer plus the pages private to each
  descendant, every ``--poll`` seconds: see ``tree_rss_bytes``) and kills the tree (its own process group)
  as soon as it exceeds ``--memory-budget``: "over memory budget". After the trial the peak is the
  larger of the polled peak and ``os.wait4``'s ``ru_maxrss`` (exact, for the largest single process):
  a spike between two polls still marks the trial over budget. The peak includes each trainer's
  start-up (torch, DeepSpeed or open_clip_train imports, DeepSpeed's compiler probe, the model, the
  optimizer state): the smallest N shows that floor, about 1 GiB.
* Data loading runs in the training process for both trainers (``--workers 0``), and neither side pays
  for it in the timed step: ds_clip's loader hands the trainer a step's k micro-batches at once and the
  trainer's step time excludes it; open_clip's loader is wrapped so that it fetches a step's k
  micro-batches before the step starts (open_clip keeps all k of them in the step anyway, so this holds
  no extra memory). Both use their own synthetic data (``--dataset-type synthetic``).
* The timed step is the last of ``--steps`` (default 2: the first pays one-time costs such as creating
  the optimizer state). ds_clip: the trainer's own logged step time (``step_time_s`` of its
  ``metrics.csv``, ds_clip/training/metrics.py, ``--log-every-n-steps 1``): ``Trainer._step``, i.e. the cached
  step, the optimizer step and the temperature clamp (``ds_clip.train.main`` runs in the trial, with
  ``Trainer._step`` wrapped only to tell the watchdog when a step begins and ends). open_clip: from
  the moment the step's k micro-batches are loaded to the return of ``optimizer.step`` (the clamp
  follows it). A step still running ``--time-cap`` seconds after it began is killed: "over time cap".
  Start-up and data loading are not capped per step; a trial whose whole wall time passes
  ``--setup-cap`` + steps × ``--time-cap`` is killed as "over setup cap".
* A trial that dies by itself (an exception, the kernel's OOM killer) is a "crash", with the tail of its
  log. For each (loss, method) the doubling stops at the first trial that is not "ok"; the methods run
  interleaved at each N so that machine load drifts alike for all of them.
* The model: the same open_clip config for both trainers, written as a ``local-dir:`` folder (16 px
  images, patch 8, one layer, width 64, embed dim 64, context 8), so that the loss, not the towers,
  dominates at large N. SigLIP uses it with ``init_logit_scale`` ln 10 and ``init_logit_bias`` -10,
  what open_clip's ``--siglip`` sets. fp32, one thread per trial (``--threads``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: benchmarks.* must import
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_accum import machine_info, open_clip_argv  # noqa: E402

PROG = "benchmarks/bench_largest.py"
GIB = 1024**3
MIB = 1024**2
METHODS = ("open_clip", "dense", "tiled")
LOSSES = ("clip", "siglip")
METHOD_LABELS = {
    "open_clip": "open_clip_train --accum-freq k",
    "dense": "ds_clip dense loss",
    "tiled": "ds_clip tiled loss",
}
OK = "ok"
OVER_MEMORY = "over memory budget"
OVER_TIME = "over time cap"
OVER_SETUP = "over setup cap"
CRASH = "crash"

# The model both trainers build (an open_clip config): small enough that at large N the loss, not the
# towers, costs the time and the memory. The vocabulary is open_clip's (both trainers' synthetic
# captions go through its tokenizer).
LARGEST_MODEL: dict[str, Any] = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 1},
}
# What open_clip_train's --siglip passes to create_model (open_clip_train/main.py): the same values in
# the config make ds-clip-train build the same SigLIP model.
SIGLIP_INIT = {"init_logit_scale": math.log(10), "init_logit_bias": -10.0}


class BenchError(ValueError):
    """Bad benchmark arguments (the message names the flag)."""


@dataclass
class LargestSettings:
    memory_budget_gib: float = 16.0
    """Peak RSS of a trial's process tree above this: over memory budget."""
    time_cap_s: float = 600.0
    """A step running longer than this: over time cap."""
    micro_batch_size: int = 256
    """m, fixed; k = N / m."""
    start_n: int | None = None
    """First N (a multiple of m); default m."""
    max_n: int = 2**20
    """Stop doubling past this N even if the trials still fit."""
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    losses: list[str] = field(default_factory=lambda: list(LOSSES))
    steps: int = 2
    """Optimizer steps per trial; the last one is timed."""
    tile_size: int = 4096
    """--loss-tile-size of the tiled loss."""
    threads: int = 1
    setup_cap_s: float = 1200.0
    """Start-up and data loading of a whole trial (beyond steps x time cap) before it is killed."""
    poll_s: float = 0.05

    def first_n(self) -> int:
        return self.start_n or self.micro_batch_size


@dataclass
class Trial:
    """One fresh process training ``steps`` optimizer steps of N pairs with one method and loss."""

    method: str
    loss: str
    n: int
    m: int
    k: int
    status: str
    peak_rss_mib: float
    """Largest of the two below."""
    polled_peak_mib: float
    """Largest tree memory seen by the watchdog's polls (see tree_rss_bytes)."""
    maxrss_mib: float
    """os.wait4's ru_maxrss: the peak RSS of the trainer process (or of a reaped descendant), exact."""
    wall_s: float
    """The whole trial: start-up, data, steps, shutdown."""
    step_s: float | None = None
    """The timed (last) step; None unless every step finished."""
    step_times_s: list[float] = field(default_factory=list)
    data_s: float | None = None
    """Data loading of the timed step (not in step_s)."""
    exit: str = ""
    """How the process ended: 'exit 0', 'exit 1', 'signal 9', 'killed: ...'."""
    detail: str = ""
    """Why it is not ok (budget crossed at what RSS, step running how long), or the tail of a crash log."""

    @property
    def s_per_sample(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.n


# --------------------------------------------------------------------------- model folders


def write_model_dirs(root: Path) -> dict[str, str]:
    """LOSS -> 'local-dir:ROOT/LOSS' (open_clip_config.json, as ds_clip_harness.models writes its models)."""
    out = {}
    for loss in LOSSES:
        cfg = dict(LARGEST_MODEL, **(SIGLIP_INIT if loss == "siglip" else {}))
        d = root / f"largest_{loss}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
        out[loss] = f"local-dir:{d}"
    return out


# --------------------------------------------------------------------------- trial argv


def ds_clip_argv(model: str, loss: str, impl: str, n: int, s: LargestSettings, logs: str) -> list[str]:
    m = s.micro_batch_size
    return [
        "--model", model,
        "--dataset-type", "synthetic",
        "--train-num-samples", str(s.steps * n),
        "--batch-size", str(m),
        "--accum-freq", str(n // m),
        "--max-steps", str(s.steps),
        "--workers", "0",
        "--precision", "fp32",
        "--zero-stage", "0",
        "--loss-impl", impl,
        "--loss-tile-size", str(s.tile_size),
        "--lr", "1e-5",
        "--wd", "0.1",
        "--warmup", "0",
        "--seed", "0",
        "--logs", logs,
        "--name", "trial",
        "--log-every-n-steps", "1",
        "--report-to", "csv",
        *(["--siglip"] if loss == "siglip" else []),
    ]  # fmt: skip


def trial_payload(
    method: str, loss: str, n: int, s: LargestSettings, models: dict[str, str], tmp: str
) -> dict:
    m = s.micro_batch_size
    logs = os.path.join(tmp, "logs")
    if method == "open_clip":
        # bench_accum's argv for open_clip's trainer (fp32, synthetic data, --workers 0, no checkpoints),
        # with SigLIP's flag where asked.
        argv = open_clip_argv(models[loss], m, n // m, s.steps, "fp32", "cpu", False, logs)
        argv += ["--siglip"] if loss == "siglip" else []
    else:
        argv = ds_clip_argv(models[loss], loss, method, n, s, logs)
    return {
        "trainer": "open_clip" if method == "open_clip" else "ds_clip",
        "argv": argv,
        "k": n // m,
        "threads": s.threads,
        "progress": os.path.join(tmp, "progress.jsonl"),
        "metrics_csv": os.path.join(logs, "trial", "metrics.csv"),
    }


# --------------------------------------------------------------------------- the child process


class _Progress:
    """Child side: one JSON line per event, flushed at once, read by the parent's watchdog."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)  # noqa: SIM115  (lives as long as the process)
        self.begin_t = 0.0
        self.step = 0

    def begin(self, data_s: float | None = None) -> None:
        self.begin_t = time.perf_counter()
        self.f.write(
            json.dumps({"event": "begin", "step": self.step, "t": time.time(), "data_s": data_s}) + "\n"
        )

    def end(self) -> None:
        step_s = time.perf_counter() - self.begin_t
        self.f.write(
            json.dumps({"event": "end", "step": self.step, "t": time.time(), "step_s": step_s}) + "\n"
        )
        self.step += 1


def child_main(payload_path: str) -> int:
    """A trial: run one trainer with its step boundaries reported to the progress file."""
    payload = json.loads(Path(payload_path).read_text())
    import torch

    torch.set_num_threads(payload["threads"])
    progress = _Progress(payload["progress"])
    if payload["trainer"] == "ds_clip":
        return _child_ds_clip(payload, progress)
    return _child_open_clip(payload, progress)


def _child_ds_clip(payload: dict, progress: _Progress) -> int:
    # ds-clip-train's own entry point; Trainer._step is wrapped only to report when a step begins and ends
    # (the watchdog's time cap); the timed figure is the trainer's own logged step time.
    import ds_clip.training.trainer as trainer_mod
    from ds_clip.train import main

    inner = trainer_mod.Trainer._step

    def _step(self, *args, **kwargs):
        progress.begin()
        result = inner(self, *args, **kwargs)
        progress.end()
        return result

    trainer_mod.Trainer._step = _step
    return main(payload["argv"])


class _StepBatches:
    """open_clip's data loader, fetching each step's k micro-batches before the step begins."""

    def __init__(self, inner, k: int, progress: _Progress):
        self.inner, self.k, self.progress = inner, k, progress
        self.num_batches, self.num_samples = inner.num_batches, inner.num_samples

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        it = iter(self.inner)
        while True:
            t0 = time.perf_counter()
            batches = []
            for _ in range(self.k):
                b = next(it, None)
                if b is None:
                    return
                batches.append(b)
            self.progress.begin(data_s=time.perf_counter() - t0)
            # open_clip keeps all k micro-batches of a step (accum_images / accum_texts) until its
            # optimizer step; popping them here leaves open_clip the only holder.
            while batches:
                yield batches.pop(0)


def _child_open_clip(payload: dict, progress: _Progress) -> int:
    import open_clip_train.main as oc_main

    inner_train = oc_main.train_one_epoch

    def train_one_epoch(
        model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer=None
    ):
        info = data["train"]
        info.dataloader = _StepBatches(info.dataloader, payload["k"], progress)
        inner_step = optimizer.step

        def step(*a, **kw):
            r = inner_step(*a, **kw)
            progress.end()
            return r

        optimizer.step = step
        inner_train(model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer)
        args.save_logs = False  # no checkpoint at the end of the epoch (as bench_accum does)

    oc_main.train_one_epoch = train_one_epoch
    oc_main.main(payload["argv"])
    return 0


# --------------------------------------------------------------------------- the parent: one trial


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def _status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _private_kib(pid: int) -> int:
    total = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def tree_rss_bytes(pid: int) -> int:
    """Memory of a trial's process tree: the trainer's resident set size (VmRSS) plus what is private to
    each descendant (its Private_Clean + Private_Dirty pages).

    Summing VmRSS would count pages twice that a forked child still shares with its parent: DeepSpeed's
    start-up forks and execs a compiler probe (gcc) and ninja, and a fork of a 600 MiB process briefly
    shows 600 MiB of RSS of its own. Data-loader workers (none with --workers 0) would count by what they
    hold alone.
    """
    total, todo, seen = _status_kib(pid, "VmRSS"), _children(pid), {pid}
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _private_kib(p)
        todo += _children(p)
    return total * 1024


def _read_progress(path: str) -> list[dict]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))  # the last line may be half-written
    return out


def _log_tail(path: str, chars: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _logged_times(metrics_csv: str) -> tuple[list[float], list[float]]:
    """ds-clip-train's own log (--log-every-n-steps 1 --report-to csv): step and data time of each step."""
    try:
        with open(metrics_csv, newline="") as f:
            rows = list(csv.DictReader(f))
        return [float(r["step_time_s"]) for r in rows], [float(r["data_time_s"]) for r in rows]
    except (OSError, KeyError, ValueError):
        return [], []


def run_trial(method: str, loss: str, n: int, s: LargestSettings, models: dict[str, str], log=print) -> Trial:
    """One trial in a fresh process (its own process group, so that the watchdog can kill the whole tree)."""
    m = s.micro_batch_size
    budget = s.memory_budget_gib * GIB
    with tempfile.TemporaryDirectory(prefix="largest_") as tmp:
        payload = trial_payload(method, loss, n, s, models, tmp)
        payload_path = os.path.join(tmp, "payload.json")
        Path(payload_path).write_text(json.dumps(payload))
        log_path = os.path.join(tmp, "trial.log")
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            OMP_NUM_THREADS=str(s.threads),
            MKL_NUM_THREADS=str(s.threads),
            PYTHONUNBUFFERED="1",
        )
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)  # a world of one of its own, whatever the parent runs in
        code = (
            "import sys; from benchmarks.bench_largest import child_main; sys.exit(child_main(sys.argv[1]))"
        )
        t0 = time.monotonic()
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-c", code, payload_path],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=tmp,
                start_new_session=True,
            )
        peak, killed, detail = 0, "", ""
        wall_limit = s.setup_cap_s + s.steps * s.time_cap_s
        try:
            while True:
                pid, wstatus, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid == proc.pid:
                    break
                rss = tree_rss_bytes(proc.pid)
                peak = max(peak, rss)
                now = time.monotonic()
                if not killed and rss > budget:
                    killed = OVER_MEMORY
                    detail = f"RSS {rss / MIB:.0f} MiB > budget {budget / MIB:.0f} MiB"
                if not killed:
                    events = _read_progress(payload["progress"])
                    open_step = events[-1] if events and events[-1]["event"] == "begin" else None
                    if open_step is not None and time.time() - open_step["t"] > s.time_cap_s:
                        killed = OVER_TIME
                        detail = f"step {open_step['step'] + 1} still running after {s.time_cap_s:g} s"
                    elif now - t0 > wall_limit:
                        killed = OVER_SETUP
                        detail = f"trial still running after {wall_limit:g} s (start-up and data loading)"
                if killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)  # the trial's process group: it and its children
                    _, wstatus, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(s.poll_s)
        except BaseException:  # Ctrl-C or an error here: leave no trial behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(wstatus)  # reaped by wait4: keep Popen from waiting
        wall = time.monotonic() - t0
        polled, maxrss = peak, usage.ru_maxrss * 1024  # Linux: KiB
        peak = max(polled, maxrss)
        rc = proc.returncode
        exit_text = f"killed: {killed}" if killed else (f"exit {rc}" if rc >= 0 else f"signal {-rc}")
        events = _read_progress(payload["progress"])
        ends = [e for e in events if e["event"] == "end"]
        begins = [e for e in events if e["event"] == "begin"]
        if payload["trainer"] == "ds_clip":
            step_times, data_times = _logged_times(payload["metrics_csv"])
        else:
            step_times, data_times = [e["step_s"] for e in ends], [e["data_s"] for e in begins]
        status = killed
        if not status and peak > budget:
            status, detail = OVER_MEMORY, f"peak RSS {peak / MIB:.0f} MiB > budget {budget / MIB:.0f} MiB"
        if not status and (rc != 0 or len(step_times) < s.steps):
            status = CRASH
            detail = _log_tail(log_path)
            if rc == -signal.SIGKILL:
                detail = "killed by SIGKILL (not by the benchmark: the kernel's OOM killer?)\n" + detail
        if not status and max(step_times) > s.time_cap_s:
            status, detail = OVER_TIME, f"a step took {max(step_times):.1f} s > cap {s.time_cap_s:g} s"
        status = status or OK
        done = len(step_times) >= s.steps
        trial = Trial(
            method=method,
            loss=loss,
            n=n,
            m=m,
            k=n // m,
            status=status,
            peak_rss_mib=round(peak / MIB, 1),
            polled_peak_mib=round(polled / MIB, 1),
            maxrss_mib=round(maxrss / MIB, 1),
            wall_s=round(wall, 2),
            step_s=step_times[s.steps - 1] if done else None,
            step_times_s=step_times,
            data_s=data_times[s.steps - 1] if len(data_times) >= s.steps else None,
            exit=exit_text,
            detail=detail,
        )
    per = f"{1e3 * trial.s_per_sample:.3f} ms/sample" if trial.s_per_sample is not None else "-"
    log(
        f"[largest] {loss:6s} {method:9s} N={n:<8d} k={n // m:<5d} {status:18s} {per:>18s}  "
        f"peak {trial.peak_rss_mib:.0f} MiB  wall {wall:.1f} s"
    )
    return trial


# --------------------------------------------------------------------------- the search


def _same_trial(t: Trial, method: str, loss: str, n: int, m: int) -> bool:
    return (t.method, t.loss, t.n, t.m) == (method, loss, n, m)


def search(s: LargestSettings, done: Sequence[Trial] = (), save=None, log=print) -> list[Trial]:
    """Double N from ``start_n`` for every (loss, method) until a trial is not ok (or N > max_n).

    At each N the methods still going run one after another (interleaved), each in a fresh process.
    ``done`` holds trials of an earlier, interrupted run with the same settings: they are not run again.
    ``save(trials)`` is called after every trial.
    """
    trials = list(done)
    with tempfile.TemporaryDirectory(prefix="largest_models_") as root:
        models = write_model_dirs(Path(root))
        for loss in s.losses:
            alive = list(s.methods)
            n = s.first_n()
            while alive and n <= s.max_n:
                for method in list(alive):
                    old = [t for t in trials if _same_trial(t, method, loss, n, s.micro_batch_size)]
                    t = old[0] if old else run_trial(method, loss, n, s, models, log=log)
                    if not old:
                        trials.append(t)
                        if save is not None:
                            save(trials)
                    if t.status != OK:
                        alive.remove(method)
                n *= 2
    return trials


def largest(trials: Sequence[Trial], method: str, loss: str) -> tuple[Trial | None, Trial | None]:
    """(the ok trial of the largest N, the first trial that was not ok) for one method and loss."""
    rows = sorted((t for t in trials if t.method == method and t.loss == loss), key=lambda t: t.n)
    best = stop = None
    for t in rows:
        if t.status == OK:
            best = t
        else:
            stop = t
            break
    return best, stop


# --------------------------------------------------------------------------- report


def _fmt_n(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def markdown(trials: Sequence[Trial], settings: dict | None = None) -> str:
    """Two tables: the largest N per (loss, method), then every trial."""
    losses = [x for x in LOSSES if any(t.loss == x for t in trials)]
    methods = [x for x in METHODS if any(t.method == x for t in trials)]
    budget = cap = ""
    if settings:
        budget = f"{settings['memory_budget_gib']:g} GiB"
        cap = f"{settings['time_cap_s']:g} s"
    lines = [
        "| loss | method | largest N (k) | ms/sample at it | peak RSS at it | next N: why not |",
        "|---|---|---|---|---|---|",
    ]
    for loss in losses:
        for method in methods:
            best, stop = largest(trials, method, loss)
            why = "–" if stop is None else f"{_fmt_n(stop.n)}: {stop.status}"
            if stop is None and best is not None:
                why = "not tried (--max-n)"
            if best is None:
                lines.append(f"| {loss} | {METHOD_LABELS[method]} | none | – | – | {why} |")
                continue
            lines.append(
                f"| {loss} | {METHOD_LABELS[method]} | **{_fmt_n(best.n)}** ({best.k}) | "
                f"{1e3 * best.s_per_sample:.3f} | {best.peak_rss_mib:.0f} MiB | {why} |"
            )
    head = f"Budget {budget}, time cap {cap} per step." if settings else ""
    every = [
        "| loss | method | N | k | status | s/step | ms/sample | peak RSS MiB | data s/step | trial wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    key = {m: i for i, m in enumerate(METHODS)}
    for t in sorted(trials, key=lambda t: (LOSSES.index(t.loss), key[t.method], t.n)):
        every.append(
            f"| {t.loss} | {t.method} | {t.n} | {t.k} | {t.status} | "
            f"{'–' if t.step_s is None else f'{t.step_s:.2f}'} | "
            f"{'–' if t.s_per_sample is None else f'{1e3 * t.s_per_sample:.3f}'} | {t.peak_rss_mib:.0f} | "
            f"{'–' if t.data_s is None else f'{t.data_s:.2f}'} | {t.wall_s:.0f} |"
        )
    parts = [p for p in (head, "\n".join(lines), "\n".join(every)) if p]
    return "\n\n".join(parts)


def plot(trials: Sequence[Trial], path: Path, settings: dict | None = None) -> Path:
    """Time per sample vs N per method (log-log), the largest N of each method starred, the N that failed
    crossed, and why in the corner; CLIP | SigLIP panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    losses = [x for x in LOSSES if any(t.loss == x for t in trials)] or list(LOSSES)
    fig, axes = plt.subplots(1, len(losses), figsize=(5.4 * len(losses), 4.4), dpi=80, squeeze=False)
    handles = {}
    for ax, loss in zip(axes[0], losses):
        notes = []
        for i, method in enumerate(METHODS):
            ok = sorted((t for t in trials if t.loss == loss and t.method == method and t.status == OK),
                        key=lambda t: t.n)  # fmt: skip
            best, stop = largest(trials, method, loss)
            color = f"C{i}"
            if ok:
                (line,) = ax.plot([t.n for t in ok], [1e3 * t.s_per_sample for t in ok], "o-", color=color)
                handles[method] = line
            if best is not None:
                y = 1e3 * best.s_per_sample
                ax.plot([best.n], [y], "*", color=color, ms=17, mec="k", zorder=5)
                if stop is not None:  # the N that failed, at the height of the last one that trained
                    ax.plot([stop.n], [y], "x", color=color, ms=9, mew=2)
            if best is not None or stop is not None:
                why = f" ({_fmt_n(stop.n)}: {stop.status})" if stop is not None else ""
                notes.append((f"{method}: {_fmt_n(best.n) if best else 'none'}{why}", color))
        for j, (text, color) in enumerate(notes):
            ax.text(0.98, 0.04 + 0.07 * (len(notes) - 1 - j), text, transform=ax.transAxes, ha="right",
                    fontsize=8, color=color)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_n(int(v)) if v >= 1 else f"{v:g}"))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.margins(x=0.08, y=0.15)
        ax.set_xlabel("global batch N (pairs per optimizer step; k = N/m)")
        ax.set_title(
            {"clip": "CLIP", "siglip": "SigLIP"}[loss] + ": largest N (×: the N that failed)", fontsize=10
        )
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("ms per sample (the timed step)")
    shown = [m for m in METHODS if m in handles]
    fig.legend([handles[m] for m in shown], [METHOD_LABELS[m] for m in shown], loc="lower center", ncol=3,
               fontsize=8, frameon=False)  # fmt: skip
    if settings:
        fig.suptitle(
            f"The largest global batch within {settings['memory_budget_gib']:g} GiB (peak RSS) and "
            f"{settings['time_cap_s']:g} s per optimizer step; one process, "
            f"m = {settings['micro_batch_size']}",
            fontsize=10,
        )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the flag, as the checks in settings_from_args
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Find, by doubling N, the largest global batch that trains one optimizer step within a "
        "memory budget and a time cap: open_clip_train --accum-freq k vs ds_clip's dense and tiled loss.",
    )
    d = LargestSettings()
    p.add_argument("--memory-budget", type=float, default=d.memory_budget_gib, metavar="GIB",
                   help="peak RSS of a trial's process tree, GiB (default: %(default)s)")  # fmt: skip
    p.add_argument("--time-cap", type=float, default=d.time_cap_s, metavar="S",
                   help="seconds one optimizer step may take (default: %(default)s)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=d.micro_batch_size, metavar="M",
                   help="m, pairs per micro-batch (fixed; k = N/m) (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--start-n", type=int, default=None, metavar="N", help="first N, a multiple of m (default: m)"
    )
    p.add_argument(
        "--max-n", type=int, default=d.max_n, metavar="N", help="largest N tried (default: %(default)s)"
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=d.methods)
    p.add_argument("--losses", nargs="+", choices=LOSSES, default=d.losses)
    p.add_argument("--steps", type=int, default=d.steps,
                   help="optimizer steps per trial, the last timed (default: %(default)s)")  # fmt: skip
    p.add_argument("--tile-size", type=int, default=d.tile_size, metavar="PAIRS",
                   help="--loss-tile-size of the tiled loss (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=d.threads, help="torch threads per trial (default: %(default)s)"
    )
    p.add_argument("--setup-cap", type=float, default=d.setup_cap_s, metavar="S",
                   help="seconds of start-up and data loading a trial may take beyond steps x --time-cap "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--poll", type=float, default=d.poll_s, metavar="S",
                   help="seconds between two RSS polls (default: %(default)s)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the trials here (after every trial)")
    p.add_argument("--resume", action="store_true",
                   help="with --json: keep the trials already in that file (same settings), "
                   "run the rest")  # fmt: skip
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="render the tables (and --img) from a saved --json file; runs nothing")  # fmt: skip
    p.add_argument("--img", type=Path, default=None, metavar="PNG", help="write the plot here")
    return p


def settings_from_args(a: argparse.Namespace) -> LargestSettings:
    def positive(flag: str, value: float) -> None:
        if not value > 0:
            raise BenchError(f"{flag} must be > 0, got {value:g}")

    positive("--memory-budget", a.memory_budget)
    positive("--time-cap", a.time_cap)
    positive("--batch-size", a.batch_size)
    positive("--steps", a.steps)
    positive("--tile-size", a.tile_size)
    positive("--threads", a.threads)
    positive("--setup-cap", a.setup_cap)
    positive("--poll", a.poll)
    m = a.batch_size
    start = a.start_n if a.start_n is not None else m
    if a.start_n is not None and (a.start_n < m or a.start_n % m):
        raise BenchError(f"--start-n must be a multiple of --batch-size {m} (k = N/m), got {a.start_n}")
    if a.max_n < start:
        raise BenchError(f"--max-n {a.max_n} is below the first N ({start}: --start-n, else --batch-size)")
    if a.resume and a.json is None:
        raise BenchError("--resume needs --json (the file whose trials to keep)")
    total_gib = _meminfo_gib("MemTotal")
    if total_gib is not None and a.memory_budget > total_gib:
        raise BenchError(
            f"--memory-budget {a.memory_budget:g} GiB is more than this machine's memory "
            f"({total_gib:.1f} GiB): the kernel would kill the trials first"
        )
    if "open_clip" in a.methods:
        import importlib.util

        if importlib.util.find_spec("pandas") is None:
            raise BenchError(
                "--methods open_clip needs pandas (open_clip_train imports it): pip install -e '.[bench]'"
            )
    return LargestSettings(
        memory_budget_gib=a.memory_budget,
        time_cap_s=a.time_cap,
        micro_batch_size=m,
        start_n=a.start_n,
        max_n=a.max_n,
        methods=[x for x in METHODS if x in a.methods],
        losses=[x for x in LOSSES if x in a.losses],
        steps=a.steps,
        tile_size=a.tile_size,
        threads=a.threads,
        setup_cap_s=a.setup_cap,
        poll_s=a.poll,
    )


def _meminfo_gib(key: str) -> float | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024**2
    return None


# Settings that change what a trial measures: a --resume run must match them.
_RESUME_KEYS = ("memory_budget_gib", "time_cap_s", "micro_batch_size", "steps", "tile_size", "threads")


def load_json(path: Path, flag: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        data["trials"] = [Trial(**t) for t in data["trials"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise BenchError(f"{flag} {path}: cannot read trials ({e})") from None
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if a.report:
            data = load_json(a.report, "--report")
            print(markdown(data["trials"], data.get("settings")))
            info = data.get("machine", {})
            print(f"\n{a.report}: {info.get('date')} load {info.get('loadavg')} argv {data.get('argv')}")
            if a.img:
                print(f"wrote {plot(data['trials'], a.img, data.get('settings'))}")
            return 0
        s = settings_from_args(a)
        done: list[Trial] = []
        if a.resume and a.json.exists():
            old = load_json(a.json, "--json")
            diff = [k for k in _RESUME_KEYS if old.get("settings", {}).get(k) != asdict(s)[k]]
            if diff:
                raise BenchError(f"--resume: {a.json} was measured with other settings ({', '.join(diff)})")
            done = old["trials"]
    except BenchError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    avail = _meminfo_gib("MemAvailable")
    if avail is not None and s.memory_budget_gib > avail:
        print(f"[largest] warning: --memory-budget {s.memory_budget_gib:g} GiB > available memory "
              f"{avail:.1f} GiB: the kernel may kill a trial before the budget does",
              file=sys.stderr)  # fmt: skip
    info = machine_info("cpu")
    argv_list = list(argv if argv is not None else sys.argv[1:])
    t0 = time.monotonic()

    def save(trials: list[Trial]) -> None:
        if a.json is None:
            return
        out = {
            "machine": {
                **info,
                "loadavg_now": list(os.getloadavg()),
                "wall_s": round(time.monotonic() - t0, 1),
            },
            "argv": argv_list,
            "settings": asdict(s),
            "model": LARGEST_MODEL,
            "trials": [asdict(t) for t in trials],
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, a.json)

    trials = search(s, done=done, save=save)
    save(trials)
    print(markdown(trials, asdict(s)))
    print(f"\n{info['date']} | {info.get('cpu')} x{info['cpus']} | load {info['loadavg']} -> "
          f"{[round(x, 2) for x in os.getloadavg()]} | {time.monotonic() - t0:.0f} s")  # fmt: skip
    if a.img:
        print(f"wrote {plot(trials, a.img, asdict(s))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
