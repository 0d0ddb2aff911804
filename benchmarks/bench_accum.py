"""What --accum-freq costs: time, memory, cache and network per optimizer step, next to open_clip's loop.

Run from the repository root with ds_clip installed (scripts/setup.sh); `--open-clip` needs pandas (the
`bench` extra; open_clip_train imports it). Quick look (one model, one rank, about a minute on 2 CPU cores):

    python benchmarks/bench_accum.py --models ds-clip-tiny --k 1 2 4 8 --open-clip

The exact commands behind docs/benchmarks.md (five runs, about 21 minutes on 2 cores) are listed there;
``--json`` saves the raw measurements and ``--report FILE... --img-dir DIR`` re-renders tables and plots.
GPU: ``bash scripts/gpu_check.sh`` (ViT-B-32 at 224 px, bf16, ZeRO-2, k in {1, 4}, under 5 minutes).

How it measures, and why that way:

* One DeepSpeed engine per (model, W, ZeRO stage) runs every mode on the same weights, *interleaved*
  step by step: a plain step (forward + loss + ``engine.backward`` + ``engine.step`` on one micro-batch
  of m, no cache: the baseline) and ``cached_step`` at each k, with and without activation
  checkpointing (open_clip's ``set_grad_checkpointing`` toggles at run time). So every ratio compares
  steps taken seconds apart in one process, on a machine whose load drifts.
* Warm-up steps (the plain step and the smallest k, which pay every one-time cost) are not timed. Time per step is wall time (with a CUDA
  synchronize on a GPU); ``engine.step`` (the optimizer, paid once per step whatever k is) is timed
  apart so the compute overhead can be compared with theory, (4k-1)/(3k).
* Memory: one extra, untimed step per mode after the timed ones. On the CPU: free heap memory is
  returned to the OS (glibc ``malloc_trim``), the peak resident set size (Linux ``VmHWM``) is reset
  through ``/proc/self/clear_refs``, and the step's peak RSS is read back, with the RSS before it
  as "base". (Trimming before *timed* steps would make them pay page faults that a training loop
  does not pay; hence the separate step.) On a GPU ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats``.
* Network: DeepSpeed's comms logger counts the engine's collectives (gradient all-reduce /
  reduce-scatter, ZeRO-3 parameter all-gathers). The loss's embedding all-gather goes through
  ``torch.distributed`` directly (open_clip's ``gather_features``), which that logger does not see: a
  counting shim on ``torch.distributed`` is switched on while the loss runs (from the loss call up to
  the next forward of the model), so it counts the loss's collectives and nothing of DeepSpeed's.
* open_clip: its own trainer, ``open_clip_train.main.main(argv)`` with ``--dataset-type synthetic``,
  one process on the CPU, same model, m, k and precision. Its data loader is drained before the
  loop (so neither side pays data loading) and its ``optimizer.step`` is wrapped to time each step.
  Its synthetic data (one blank image, one caption) differs from ours: fine for time and memory.
  Every measurement (ours and open_clip's) runs in a fresh process, alternating, with the same
  number of threads (``--threads``, default 1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: ds_clip_harness (not installed) must import
    sys.path.insert(0, str(REPO_ROOT))

MIB = 1024 * 1024

# Extra model configs the benchmark registers with open_clip (in a folder it writes), so that our
# engine and open_clip's trainer build the same model by the same name.
BENCH_SMALL = {
    "embed_dim": 256,
    "vision_cfg": {"image_size": 64, "layers": 4, "width": 256, "patch_size": 8, "head_width": 64},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 256, "heads": 4, "layers": 4},
}
EXTRA_MODELS = {"bench-small": BENCH_SMALL}
MODES = ("plain", "cached")


class BenchError(ValueError):
    """Bad benchmark arguments (the message names the flag)."""


@dataclass
class BenchSettings:
    """One benchmark run: the product of the axes below, on generated data."""

    models: list[str] = field(default_factory=lambda: ["ds-clip-tiny"])
    """open_clip model names (built-in ds-clip-* and bench-small included)."""
    image_size: int | None = None
    """Override every model's image size (reduced resolution for ViT-B-32 on a CPU)."""
    micro_batch_size: int = 8
    """m, pairs per micro-batch per rank (fixed for every k)."""
    accum_freqs: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    world_sizes: list[int] = field(default_factory=lambda: [1])
    zero_stages: list[int | None] = field(default_factory=lambda: [None])
    """ZeRO stages, each its own engine; None: the preset ds-clip-train picks without --ds-config for that
    world size and --coalesce-grad-reduction (ds_config.default_preset: ZeRO-0 on one rank, ZeRO-1 on more)."""
    coalesce: list[str] = field(default_factory=lambda: ["off"])
    """--coalesce-grad-reduction values, each its own engine: 'off', 'on' (ZeRO 1-3 only: DeepSpeed refuses
    ZeRO-0, which is then measured with 'off' alone, as the reference)."""
    grad_checkpointing: str = "off"
    """'off', 'on' or 'both'."""
    precision: str = "fp32"
    device: str = "cpu"
    steps: int = 2
    """Timed steps per mode and repeat."""
    warmup: int = 1
    """Untimed steps per mode before the timed ones."""
    repeats: int = 1
    """Fresh processes per configuration, alternating ours and open_clip's."""
    open_clip: bool = False
    """Also run open_clip's own trainer (W=1, CPU or one GPU) at --open-clip-k."""
    open_clip_k: list[int] = field(default_factory=lambda: [1, 8])
    threads: int = 1
    seed: int = 0

    def checkpointing_modes(self) -> list[bool]:
        return {"off": [False], "on": [True], "both": [False, True]}[self.grad_checkpointing]


@dataclass
class Measurement:
    """One timed optimizer step (or the median of a few, after aggregation)."""

    impl: str
    """'ds_clip' or 'open_clip'."""
    mode: str
    """'plain' (baseline, one micro-batch, no cache), 'cached' (ds_clip's step) or 'open_clip'."""
    model: str
    params_m: float
    image_size: int
    world_size: int
    zero_stage: int | None
    grad_checkpointing: bool
    precision: str
    device: str
    micro_batch_size: int
    accum_freq: int
    rep: int
    step_s: float
    optimizer_s: float | None
    peak_mib: float
    base_mib: float
    cache_bytes: int = 0
    inputs_bytes: int = 0
    logits_bytes: int = 0
    loss_collectives: dict[str, list[int]] = field(default_factory=dict)
    """Collectives issued by the loss (op -> [calls, bytes of the local tensors])."""
    engine_collectives: dict[str, list[int]] = field(default_factory=dict)
    """DeepSpeed's collectives in the step (op -> [calls, message bytes as its comms logger counts])."""
    grad_reduction_passes: float | None = None
    """Gradient bytes reduced / the model's fp32 gradient bytes (1 = the whole gradient once)."""
    loss: float | None = None
    coalesce: str = "off"
    """--coalesce-grad-reduction of the engine ('on': one gradient reduction per step on ZeRO 1-3)."""
    preset: str = ""
    """The DeepSpeed preset the engine was built from, "(default)" when it is ds-clip-train's default choice."""

    @property
    def samples(self) -> int:
        """Pairs this rank trained on in the step."""
        return self.micro_batch_size * (1 if self.mode == "plain" else self.accum_freq)

    @property
    def s_per_sample(self) -> float:
        return self.step_s / self.samples

    @property
    def compute_s_per_sample(self) -> float:
        return (self.step_s - (self.optimizer_s or 0.0)) / self.samples

    @property
    def transient_mib(self) -> float:
        return self.peak_mib - self.base_mib


# --------------------------------------------------------------------------- model configs


def bench_config_dir() -> Path:
    """Write the extra configs (bench-small) into a folder and register it with open_clip."""
    import open_clip

    import ds_clip.models.model  # noqa: F401  (registers the built-in ds-clip-* configs)

    root = Path(tempfile.gettempdir()) / f"ds_clip_bench_models_{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    for name, cfg in EXTRA_MODELS.items():
        _write_json(root / f"{name}.json", cfg)
    open_clip.add_model_config(root)
    return root


def resolve_model(name: str, image_size: int | None) -> str:
    """The registered name of ``name`` at ``image_size`` (a copy of its config, e.g. ViT-B-32-64px)."""
    import open_clip

    root = bench_config_dir()
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        known = ", ".join(sorted(set(open_clip.list_models()) & {"ViT-B-32", "ViT-B-16", "RN50"}))
        raise BenchError(
            f"--models: unknown open_clip model {name!r} (e.g. ds-clip-tiny, bench-small, {known})"
        )
    current = cfg["vision_cfg"]["image_size"]
    if image_size is None or image_size == current:
        return name
    cfg = json.loads(json.dumps(cfg))
    cfg["vision_cfg"]["image_size"] = image_size
    patch = cfg["vision_cfg"].get("patch_size")
    if patch and image_size % patch:
        raise BenchError(f"--image-size {image_size} is not a multiple of {name}'s patch size {patch}")
    new = f"{name}-{image_size}px"
    _write_json(root / f"{new}.json", cfg)
    open_clip.add_model_config(root)
    return new


def _write_json(path: Path, obj: Any) -> None:
    text = json.dumps(obj, indent=2)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # atomic: several benchmark processes may write the same file


# --------------------------------------------------------------------------- memory


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class MemoryMeter:
    """Peak memory of a stretch of code: RSS high-water mark on the CPU, allocated bytes on a GPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def start(self) -> float:
        gc.collect()
        _malloc_trim()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / MIB
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0)
        return _proc_status_kib("VmRSS") / 1024

    def peak(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / MIB
        return _proc_status_kib("VmHWM") / 1024


def _malloc_trim() -> None:
    # glibc keeps freed heap memory mapped; give it back so RSS before a step is the live memory.
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------- collective counting


class _LossPhase:
    active = False
    counts: dict[str, list[int]] = {}


_SHIM_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
)


def _tensor_bytes(args: tuple, kwargs: dict, op: str) -> int:
    import torch

    # The local tensor each rank contributes: the second argument of all_gather*/reduce_scatter*
    # (the input), the first of all_reduce/broadcast.
    pos = 1 if op.startswith(("all_gather", "reduce_scatter")) else 0
    t = args[pos] if len(args) > pos else kwargs.get("tensor", kwargs.get("input"))
    if isinstance(t, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


@contextlib.contextmanager
def count_loss_collectives() -> Iterator[None]:
    """Wrap torch.distributed's collectives; they count only while ``_LossPhase.active``."""
    import torch.distributed as dist

    originals = {op: getattr(dist, op) for op in _SHIM_OPS if hasattr(dist, op)}

    def wrap(op: str, fn):
        def counted(*args, **kwargs):
            if _LossPhase.active:
                calls, nbytes = _LossPhase.counts.setdefault(op, [0, 0])
                _LossPhase.counts[op] = [calls + 1, nbytes + _tensor_bytes(args, kwargs, op)]
            return fn(*args, **kwargs)

        return counted

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    try:
        yield
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)


class CountingLoss:
    """A ContrastiveLoss whose call opens the loss phase; the model's next forward or backward closes it.

    cached_step calls the loss, then ``autograd.grad`` (a gather-with-grad backward issues its
    collectives there), then the one-float all-reduce that agrees on skipping; the recompute forward
    or ``engine.backward`` that follows ends the phase, before any DeepSpeed collective can run.
    """

    def __init__(self, inner):
        self.inner = inner
        self.spec = inner.spec

    def __call__(self, *args, **kwargs):
        _LossPhase.active = True
        return self.inner(*args, **kwargs)


def _end_loss_phase(*_: Any) -> None:
    _LossPhase.active = False


# --------------------------------------------------------------------------- our engine


def _engine_ops(comms) -> dict[str, dict[int, int]]:
    if comms is None:
        return {}
    return {op: {size: v[0] for size, v in by_size.items()} for op, by_size in comms.comms_dict.items()}


def _ops_delta(before: dict, after: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for op, sizes in after.items():
        calls = nbytes = 0
        for size, n in sizes.items():
            d = n - before.get(op, {}).get(size, 0)
            calls += d
            nbytes += d * size
        if calls:
            out[op] = [calls, nbytes]
    return out


def _reduction_passes(ops: dict[str, list[int]], num_params: int) -> float:
    # As RunResult.gradient_reduction_passes: reduced bytes over the fp32 gradient bytes; the few
    # tiny messages (norm and overflow checks) are noise next to a gradient and are left in.
    reduced = sum(
        ops.get(op, [0, 0])[1] for op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_fn")
    )
    return reduced / (4 * num_params)


def run_engines(settings: BenchSettings, rep: int) -> list[Measurement]:
    """Every rank of the current process group: one engine per (model, ZeRO stage, coalesce), all modes."""
    import torch.distributed as dist

    out: list[Measurement] = []
    with count_loss_collectives():
        for model in settings.models:
            for asked in settings.zero_stages:
                for coalesce in settings.coalesce:
                    stage, preset = engine_preset(asked, settings.precision, dist.get_world_size(), coalesce)
                    if coalesce == "on" and stage == 0:
                        continue  # DeepSpeed coalesces on ZeRO 1-3 only; ZeRO-0 reduces once per step anyway
                    out += _run_one_engine(settings, model, stage, rep, coalesce, preset)
                    gc.collect()
    dist.barrier()
    return out


def engine_preset(
    stage: int | None, precision: str, world_size: int, coalesce: str = "off"
) -> tuple[int, str]:
    """(ZeRO stage, preset label) of one engine: an asked stage runs on the shipped zero<stage>_<precision>
    preset; None on the preset ds-clip-train picks itself for this world size (labelled "(default)")."""
    if stage is not None:
        return stage, f"zero{stage}_{precision}"
    from ds_clip.config import parse_settings
    from ds_clip.ds_config.resolve import default_preset, load_preset

    flags = ["--precision", precision, "--coalesce-grad-reduction", coalesce]
    name, _ = default_preset(parse_settings(flags).deepspeed_request(), world_size)
    return int(load_preset(name)["zero_optimization"]["stage"]), f"{name} (default)"


def _run_one_engine(
    settings: BenchSettings, model_name: str, stage: int, rep: int, coalesce: str = "off", preset: str = ""
) -> list[Measurement]:
    import torch
    import torch.distributed as dist
    from deepspeed import comm as ds_comm

    from ds_clip.config import parse_settings
    from ds_clip.step.cached import input_dtype
    from ds_clip.training.wiring import build_run_step
    from ds_clip_harness.runs import FLAT_SCHEDULE_STEPS, RunSpec, generated_pairs, train_argv

    name = resolve_model(model_name, settings.image_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    m, ks = settings.micro_batch_size, sorted(set(settings.accum_freqs))
    spec = RunSpec(
        model=name,
        micro_batch_size=m,
        accum_freq=1,
        steps=0,
        zero_stage=stage,
        precision=settings.precision,
        count_collectives=True,
        coalesce=coalesce,
        seed=settings.seed,
    )
    # The engine and step ds-clip-train builds (ds_clip.training.wiring) from the shipped preset of this stage
    # and precision (train_argv names zero<stage>_<precision>, which is also the default preset where
    # engine_preset chose it), with open_clip's AdamW settings for ViTs.
    with tempfile.TemporaryDirectory() as preset_dir:
        s = parse_settings([*train_argv(spec, preset_dir), "--lr", "1e-5", "--wd", "0.1", "--eps", "1e-6"])
        trained = build_run_step(s, world_size=world, rank=rank, total_steps=FLAT_SCHEDULE_STEPS)
    bundle, engine = trained.bundle, trained.engine
    # ZeRO-3 has partitioned the parameters by now: ds_numel is each one's whole size.
    num_params = sum(getattr(p, "ds_numel", p.numel()) for p in bundle.model.parameters())
    engine.train()
    comms = ds_comm.comms_logger
    cuda = settings.device.startswith("cuda")
    hook = engine.module.register_forward_pre_hook(_end_loss_phase)
    # The loss counted (its collectives, apart from DeepSpeed's); the step is otherwise ds-clip-train's.
    loss_fn = trained.built.loss_fn = CountingLoss(trained.built.loss_fn)

    # Time the optimizer apart: it runs once per step whatever k is.
    inner_step, opt_time = engine.step, [0.0]

    def timed_step(*a, **kw):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = inner_step(*a, **kw)
        if cuda:
            torch.cuda.synchronize()
        opt_time[0] += time.perf_counter() - t0
        return r

    engine.step = timed_step
    inner_backward = engine.backward

    def backward(*a, **kw):
        _end_loss_phase()  # DeepSpeed's own reductions start here (ZeRO-2/3 reduce during backward)
        return inner_backward(*a, **kw)

    engine.backward = backward

    cfg = bundle.model_cfg
    size = cfg["vision_cfg"]["image_size"]
    size = size if isinstance(size, int) else size[0]
    ctx = cfg["text_cfg"].get("context_length", 77)
    vocab = cfg["text_cfg"].get("vocab_size", 49408)
    dim = cfg["embed_dim"]
    # Data generated once, outside the timed region; each rank gets distinct pairs.
    pool = [
        generated_pairs(
            range((rank * 64 + j) * m, (rank * 64 + j + 1) * m),
            image_size=size,
            context_length=ctx,
            vocab_size=vocab,
            seed=settings.seed,
        )
        for j in range(max(ks))
    ]
    dtype_bytes = torch.empty((), dtype=input_dtype(engine)).element_size()

    def plain_step() -> float:
        img, txt = pool[0]
        out = engine(image=img.to(engine.device, input_dtype(engine)), text=txt.to(engine.device))
        res = loss_fn(out["image_features"].float(), out["text_features"].float(), out["logit_scale"].float())
        _LossPhase.active = False  # the rest is DeepSpeed's (its backward reduces on ZeRO-2/3)
        engine.backward(res.backward_loss)
        engine.step()
        return float(res.value)

    def one(mode: str, k: int, ckpt: bool) -> dict[str, Any]:
        """One optimizer step of ``mode``; wall time, optimizer time, collectives, loss."""
        engine.module.set_grad_checkpointing(ckpt)
        before = _engine_ops(comms)
        _LossPhase.counts = {}
        opt_time[0] = 0.0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "plain":
            loss = plain_step()
        else:
            loss = float(trained.train(pool[:k]).loss)
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        _LossPhase.active = False
        return {"step_s": step_s, "opt_s": opt_time[0], "before": before, "loss": loss}

    def memory_step(mode: str, k: int, ckpt: bool) -> tuple[float, float]:
        meter = MemoryMeter(settings.device)
        base = meter.start()
        one(mode, k, ckpt)
        return meter.peak(), base

    def rank_max(values: list[float]) -> list[float]:
        # The largest over ranks: a step is as slow (and a job as big) as its slowest rank.
        t = torch.tensor(values, dtype=torch.float64)
        if world > 1:
            t = t.to(engine.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def measurement(
        mode: str, k: int, ckpt: bool, r: int, res: dict, mem: tuple[float, float]
    ) -> Measurement:
        kk = 1 if mode == "plain" else k
        n = world * kk * m
        step_s, opt_s = rank_max([res["step_s"], res["opt_s"]])
        engine_ops = _ops_delta(res["before"], res["after"])
        return Measurement(
            impl="ds_clip",
            mode=mode,
            model=name,
            params_m=num_params / 1e6,
            image_size=size,
            world_size=world,
            zero_stage=stage,
            grad_checkpointing=ckpt,
            precision=settings.precision,
            device=settings.device,
            micro_batch_size=m,
            accum_freq=kk,
            rep=r,
            step_s=step_s,
            optimizer_s=opt_s,
            peak_mib=mem[0],
            base_mib=mem[1],
            # fp32 leaves of all k·m pairs (both towers) + the k-1 stored embeddings in the model dtype
            # + one CPU RNG state per recomputed micro-batch.
            cache_bytes=0
            if mode == "plain"
            else 2 * kk * m * dim * 4 + 2 * (kk - 1) * m * dim * dtype_bytes + (kk - 1) * 5056,
            inputs_bytes=kk * m * (3 * size * size * dtype_bytes + ctx * 8),
            # the global loss builds both N x N fp32 logits on every rank (--local-loss: k·m x N)
            logits_bytes=2 * n * n * 4,
            loss_collectives=res["loss_ops"],
            engine_collectives=engine_ops,
            grad_reduction_passes=_reduction_passes(engine_ops, num_params),
            loss=res["loss"],
            coalesce=coalesce,
            preset=preset or f"zero{stage}_{settings.precision}",
        )

    variants = [(ckpt, mode, k) for ckpt in settings.checkpointing_modes()
                for mode, k in [("plain", 1)] + [("cached", k) for k in ks]]  # fmt: skip
    # Warm-up: the plain step and the cached step at the smallest k pay every one-time cost (optimizer
    # state, first allocations of the micro-batch shapes, the recompute path); larger k only repeat
    # those shapes, so warming them up too would double the run for nothing.
    for ckpt, mode, k in variants:
        if mode == "plain" or k == ks[0]:
            for _ in range(settings.warmup):
                one(mode, k, ckpt)
    timed: dict[tuple, list[dict]] = {}
    for _ in range(settings.steps):  # interleaved: every mode once per round
        for v in variants:
            gc.collect()
            res = one(v[1], v[2], v[0])
            res["after"] = _engine_ops(comms)
            res["loss_ops"] = dict(_LossPhase.counts)
            timed.setdefault(v, []).append(res)
    mems = {v: tuple(rank_max(list(memory_step(v[1], v[2], v[0])))) for v in variants}
    results: list[Measurement] = []
    for v in variants:
        ckpt, mode, k = v
        for i, res in enumerate(timed[v]):
            results.append(measurement(mode, k, ckpt, rep * settings.steps + i, res, mems[v]))
    hook.remove()
    engine.destroy()
    # engine, model and optimizer go with this frame (its closures hold them until it returns)
    return results


# --------------------------------------------------------------------------- open_clip's trainer


def open_clip_argv(
    model: str, m: int, k: int, steps: int, precision: str, device: str, ckpt: bool, logs: str
) -> list[str]:
    oc_precision = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}[precision]
    argv = [
        "--dataset-type", "synthetic",
        "--train-num-samples", str(steps * k * m),
        "--batch-size", str(m),
        "--accum-freq", str(k),
        "--model", model,
        "--precision", oc_precision,
        "--device", device,
        "--epochs", "1",
        "--workers", "0",
        "--lr", "1e-5",
        "--wd", "0.1",
        "--warmup", "0",
        "--seed", "0",
        "--logs", logs,
        "--name", "bench",
        "--log-every-n-steps", "1000000",
        "--save-frequency", "0",
        "--zeroshot-frequency", "0",
        "--val-frequency", "0",
        "--report-to", "",
    ]  # fmt: skip
    return argv + (["--grad-checkpointing"] if ckpt else [])


def _open_clip_entry(payload: dict, out_path: str) -> None:
    """Child process: open_clip's own trainer, its data loader drained up front, each step timed."""
    import torch

    torch.set_num_threads(payload["threads"])
    # open_clip's trainer logs every argument at INFO: keep it in a file, shown only if it fails.
    log_fd = os.open(payload["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    bench_config_dir()
    name = resolve_model(payload["model"], payload["image_size"])
    import open_clip_train.main as oc_main

    warmup, device = payload["warmup"], payload["device"]
    meter = MemoryMeter(device)
    record: dict[str, Any] = {"step_s": [], "peak_mib": [], "base_mib": [], "loss": None}
    inner_train = oc_main.train_one_epoch

    def train_one_epoch(
        model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer=None
    ):
        info = data["train"]
        batches = list(info.dataloader)  # drained before the loop: data loading is not timed

        class Preloaded(list):
            num_batches = info.dataloader.num_batches
            num_samples = info.dataloader.num_samples

        info.dataloader = Preloaded(batches)
        record["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        inner_opt_step, state = optimizer.step, {"n": 0, "t": 0.0}
        timed_steps = payload["steps"]

        # Steps: warm-up, timed, then one memory step (its peak RSS, untimed: see the module docstring).
        def step(*a, **kw):
            r = inner_opt_step(*a, **kw)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            now = time.perf_counter()
            n = state["n"]
            if warmup <= n < warmup + timed_steps:
                record["step_s"].append(now - state["t"])
            if n == warmup + timed_steps:
                record["peak_mib"].append(meter.peak())
            state["n"] = n + 1
            if state["n"] == warmup + timed_steps:
                record["base_mib"].append(meter.start())
            else:
                gc.collect()  # as before each of our timed steps
            state["t"] = time.perf_counter()
            return r

        optimizer.step = step
        gc.collect()
        state["t"] = time.perf_counter()
        inner_train(model, data, loss, epoch, optimizer, scaler, scheduler, dist_model, args, tb_writer)
        args.save_logs = False  # no checkpoint at the end of the epoch
        sys.stdout.flush()

    oc_main.train_one_epoch = train_one_epoch
    with tempfile.TemporaryDirectory() as logs:
        argv = open_clip_argv(
            name,
            payload["m"],
            payload["k"],
            payload["warmup"] + payload["steps"] + 1,
            payload["precision"],
            device,
            payload["ckpt"],
            logs,
        )
        oc_main.main(argv)
    record["model"] = name
    Path(out_path).write_text(json.dumps(record))


def run_open_clip(settings: BenchSettings, model: str, k: int, ckpt: bool, rep: int) -> list[Measurement]:
    """open_clip's trainer in a fresh process (spawn); its timed steps as Measurements."""
    import multiprocessing as mp

    payload = dict(
        model=model,
        image_size=settings.image_size,
        m=settings.micro_batch_size,
        k=k,
        steps=settings.steps,
        warmup=settings.warmup,
        precision=settings.precision,
        device=settings.device,
        ckpt=ckpt,
        threads=settings.threads,
    )
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "result.json")
        payload["log_path"] = os.path.join(d, "open_clip_train.log")
        proc = mp.get_context("spawn").Process(target=_open_clip_entry, args=(payload, out_path))
        proc.start()
        proc.join()
        if proc.exitcode != 0 or not os.path.exists(out_path):
            tail = (
                Path(payload["log_path"]).read_text()[-3000:] if os.path.exists(payload["log_path"]) else ""
            )
            raise RuntimeError(f"open_clip_train failed for {model} k={k} (exit {proc.exitcode}):\n{tail}")
        rec = json.loads(Path(out_path).read_text())
    import open_clip

    cfg = open_clip.get_model_config(rec["model"])
    out = []
    peak, base = rec["peak_mib"][0], rec["base_mib"][0]
    for i, t in enumerate(rec["step_s"]):
        out.append(
            Measurement(
                impl="open_clip",
                mode="open_clip",
                model=rec["model"],
                params_m=rec["params_m"],
                image_size=cfg["vision_cfg"]["image_size"],
                world_size=1,
                zero_stage=None,
                grad_checkpointing=ckpt,
                precision=settings.precision,
                device=settings.device,
                micro_batch_size=settings.micro_batch_size,
                accum_freq=k,
                rep=rep * settings.steps + i,
                step_s=t,
                optimizer_s=None,
                peak_mib=peak,
                base_mib=base,
            )
        )
    return out


# --------------------------------------------------------------------------- the run


def _engine_group(settings: BenchSettings, rep: int) -> list[Measurement]:
    import torch

    torch.set_num_threads(settings.threads)
    bench_config_dir()
    return run_engines(settings, rep)


def run_benchmark(settings: BenchSettings, log=print) -> list[Measurement]:
    """All configurations; each repeat starts fresh processes, ours and open_clip's alternating."""
    from ds_clip_harness.groups import spawn_group

    # spawn_group's workers pin one thread each; threads>1 is set again inside each worker.
    results: list[Measurement] = []
    for rep in range(settings.repeats):
        for w in settings.world_sizes:
            log(
                f"[bench] repeat {rep + 1}/{settings.repeats}: ds_clip, W={w}, stages {settings.zero_stages}, "
                f"coalesce {settings.coalesce}"
            )
            results += spawn_group(w, _engine_group, settings, rep)
        if settings.open_clip:
            for model in settings.models:
                for k in settings.open_clip_k:
                    for ckpt in settings.checkpointing_modes():
                        log(
                            f"[bench] repeat {rep + 1}/{settings.repeats}: open_clip {model} k={k} ckpt={ckpt}"
                        )
                        results += run_open_clip(settings, model, k, ckpt, rep)
    return results


def machine_info(device: str) -> dict[str, Any]:
    import deepspeed
    import open_clip
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "open_clip": open_clip.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg": list(os.getloadavg()),
    }
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 1024**2, 1)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# --------------------------------------------------------------------------- aggregation and report


def _key(r: Measurement) -> tuple:
    return (
        r.model,
        r.world_size,
        r.zero_stage,
        r.preset,
        r.coalesce,
        r.grad_checkpointing,
        r.impl,
        r.mode,
        r.accum_freq,
    )


def aggregate(rows: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Per configuration over timed steps and repeats: best and median time, spread, memory."""
    groups: dict[tuple, list[Measurement]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for rs in groups.values():
        r0 = rs[0]
        sps = [r.s_per_sample for r in rs]
        med = statistics.median
        row = {
            "model": r0.model,
            "params_m": round(r0.params_m, 1),
            "image_size": r0.image_size,
            "W": r0.world_size,
            "zero": r0.zero_stage,
            "preset": r0.preset,
            "coalesce": r0.coalesce,
            "ckpt": r0.grad_checkpointing,
            "impl": r0.impl,
            "mode": r0.mode,
            "m": r0.micro_batch_size,
            "k": r0.accum_freq,
            "n": len(rs),
            # Best of n: on a shared machine other work only ever adds time, so the fastest step is
            # the least disturbed estimate; the median and the spread say how noisy it was.
            "step_s": min(r.step_s for r in rs),
            "ms_per_sample": 1e3 * min(sps),
            "median_ms_per_sample": 1e3 * med(sps),
            "spread_pct": 100 * (max(sps) - min(sps)) / min(sps),
            "compute_ms_per_sample": 1e3 * min(r.compute_s_per_sample for r in rs),
            "optimizer_s": med(r.optimizer_s for r in rs) if r0.optimizer_s is not None else None,
            "peak_mib": med(r.peak_mib for r in rs),
            "transient_mib": med(r.transient_mib for r in rs),
            "cache_bytes": r0.cache_bytes,
            "inputs_bytes": r0.inputs_bytes,
            "logits_bytes": r0.logits_bytes,
            "loss_collectives": r0.loss_collectives,
            "engine_collectives": rs[-1].engine_collectives,
            "grad_reduction_passes": rs[-1].grad_reduction_passes,
        }
        out.append(row)
    _add_ratios(out)
    return out


def theory(k: int, ckpt: bool) -> float:
    """Per-sample cost of the cached step over a plain step: k-1 extra forwards per k micro-batches."""
    # Forward F, backward 2F (3F with checkpointing, which re-runs the forward): per micro-batch
    # 3F (4F) plain; the cached step adds F for k-1 of the k micro-batches.
    plain = 4.0 if ckpt else 3.0
    return (plain * k + (k - 1)) / (plain * k)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    index = {(r["model"], r["W"], r["zero"], r["coalesce"], r["ckpt"], r["mode"], r["k"]): r for r in rows}
    for r in rows:
        if r["impl"] == "ds_clip":
            base = index.get((r["model"], r["W"], r["zero"], r["coalesce"], r["ckpt"], "plain", 1))
            if base:
                r["vs_plain"] = r["ms_per_sample"] / base["ms_per_sample"]
                r["compute_vs_plain"] = r["compute_ms_per_sample"] / base["compute_ms_per_sample"]
                r["theory"] = theory(r["k"], r["ckpt"]) if r["mode"] == "cached" else 1.0
            k1 = index.get((r["model"], r["W"], r["zero"], r["coalesce"], r["ckpt"], "cached", 1))
            if k1 and r["mode"] == "cached":
                r["peak_vs_k1"] = r["peak_mib"] / k1["peak_mib"]
                r["transient_vs_k1"] = r["transient_mib"] / max(k1["transient_mib"], 1e-9)
        else:
            # open_clip runs one process: compare with our W=1 engine (the lowest ZeRO stage measured).
            ours = next(
                (
                    x
                    for z in (0, 1, 2, 3)
                    if (x := index.get((r["model"], 1, z, "off", r["ckpt"], "cached", r["k"])))
                ),
                None,
            )
            if ours:
                r["ours_vs_open_clip"] = ours["ms_per_sample"] / r["ms_per_sample"]
                r["ours_peak_vs_open_clip"] = ours["peak_mib"] / r["peak_mib"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _f(x: Any, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def markdown_tables(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: cost vs plain step; open_clip side by side; memory; network per step."""
    parts = []
    ours = sorted(
        (r for r in rows if r["impl"] == "ds_clip"),
        key=lambda r: (
            r["params_m"],
            r["W"],
            r["zero"],
            r["coalesce"],
            r["ckpt"],
            r["mode"] != "plain",
            r["k"],
        ),
    )
    parts.append(
        "| model (params) | W | ZeRO (preset) | ckpt | step | k | N | best s/step | ms/sample best / median (max) | × plain | "
        "compute × plain | theory | optimizer s | peak MiB | step transient MiB | × k=1 peak | cache |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in ours:
        n = r["W"] * r["k"] * r["m"]
        parts.append(
            f"| {r['model']} ({r['params_m']}M) | {r['W']} | {_zero_label(r)} | {'on' if r['ckpt'] else 'off'} | "
            f"{_mode_label(r)} | {r['k']} | {n} | {r['step_s']:.2f} | {r['ms_per_sample']:.1f} / "
            f"{r['median_ms_per_sample']:.1f} (+{r['spread_pct']:.0f}%) | {_f(r.get('vs_plain'))} | {_f(r.get('compute_vs_plain'))} | "
            f"{_f(r.get('theory'))} | {_f(r['optimizer_s'])} | {r['peak_mib']:.0f} | "
            f"{r['transient_mib']:.0f} | {_f(r.get('peak_vs_k1'), '.3f')} | {_fmt_bytes(r['cache_bytes'])} |"
        )
    text = "\n".join(parts)
    oc = [r for r in rows if r["impl"] == "open_clip"]
    if oc:
        index = {
            (r["model"], r["ckpt"], r["k"]): r
            for r in sorted(rows, key=lambda r: -(r["zero"] or 0))
            if r["mode"] == "cached" and r["W"] == 1 and r["coalesce"] == "off"
        }  # the lowest ZeRO stage wins, as in _add_ratios
        lines = [
            "| model | ckpt | k | open_clip ms/sample best / median (max) | ds_clip ms/sample best | ds_clip / open_clip | "
            "open_clip peak MiB | ds_clip peak MiB | open_clip step transient MiB | ds_clip step transient MiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(oc, key=lambda r: (r["params_m"], r["ckpt"], r["k"])):
            o = index.get((r["model"], r["ckpt"], r["k"]))
            lines.append(
                f"| {r['model']} | {'on' if r['ckpt'] else 'off'} | {r['k']} | {r['ms_per_sample']:.1f} / "
                f"{r['median_ms_per_sample']:.1f} (+{r['spread_pct']:.0f}%) | {_f(o and o['ms_per_sample'], '.1f')} | "
                f"{_f(r.get('ours_vs_open_clip'))} | {r['peak_mib']:.0f} | {_f(o and o['peak_mib'], '.0f')} | "
                f"{r['transient_mib']:.0f} | {_f(o and o['transient_mib'], '.0f')} |"
            )
        text += "\n\n" + "\n".join(lines)
    stored = [
        r
        for r in ours
        if r["mode"] == "cached" and not r["ckpt"] and r["zero"] in (0, None) and r["coalesce"] == "off"
    ]
    if stored:
        lines = [
            "| model | W | m | k | N | embedding cache (fp32 leaves + stored embeddings + RNG) | inputs held "
            "(k·m samples) | loss logits (2 × N × N fp32) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in stored:
            n = r["W"] * r["k"] * r["m"]
            lines.append(
                f"| {r['model']} | {r['W']} | {r['m']} | {r['k']} | {n} | {_fmt_bytes(r['cache_bytes'])} | "
                f"{_fmt_bytes(r['inputs_bytes'])} | {_fmt_bytes(r['logits_bytes'])} |"
            )
        text += "\n\n" + "\n".join(lines)
    net = [r for r in ours if r["W"] > 1]
    if net:
        lines = [
            "| model | ZeRO | step | k | loss all-gathers (calls, bytes/rank) | other loss collectives | "
            "DeepSpeed collectives (calls, bytes) | gradient reduction passes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in net:
            if r["ckpt"]:
                continue
            lc = r["loss_collectives"]
            ag = [sum(v[0] for o, v in lc.items() if o.startswith("all_gather")),
                  sum(v[1] for o, v in lc.items() if o.startswith("all_gather"))]  # fmt: skip
            other = ", ".join(f"{o} {v[0]}×{_fmt_bytes(v[1] / max(v[0], 1))}" for o, v in lc.items()
                              if not o.startswith("all_gather"))  # fmt: skip
            eng = ", ".join(
                f"{o} {v[0]} ({_fmt_bytes(v[1])})" for o, v in sorted(r["engine_collectives"].items())
            )
            lines.append(
                f"| {r['model']} | {r['zero']} | {_mode_label(r)} | {r['k']} | {ag[0]}, {_fmt_bytes(ag[1])} | "
                f"{other or '–'} | {eng or '–'} | {_f(r['grad_reduction_passes'])} |"
            )
        text += "\n\n" + "\n".join(lines)
    coalesced = coalesce_table(ours)
    if coalesced:
        text += "\n\n" + coalesced
    return text


def _zero_label(r: dict[str, Any]) -> str:
    """The ZeRO stage and the preset it came from (rows written before presets were recorded: the stage)."""
    return f"{r['zero']} ({r['preset']})" if r.get("preset") else str(r["zero"])


def _mode_label(r: dict[str, Any]) -> str:
    return r["mode"] + (" (coalesced)" if r["coalesce"] == "on" else "")


def coalesce_table(ours: Sequence[dict[str, Any]]) -> str:
    """--coalesce-grad-reduction off vs on, per (model, W, ZeRO, k) of the cached step: gradient reduction
    passes, peak memory and time per step. Empty when no engine ran with it on."""
    cells = {
        (r["model"], r["W"], r["zero"], r["k"], r["coalesce"]): r
        for r in ours
        if r["mode"] == "cached" and not r["ckpt"]
    }
    if not any(key[-1] == "on" for key in cells):
        return ""
    lines = [
        "| model | W | ZeRO | k | gradient reductions off → on | peak MiB off → on | best s/step off → on | "
        "median ms/sample off → on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, w, zero, k in sorted({key[:4] for key in cells}, key=lambda t: (t[0], t[1], t[2] or 0, t[3])):
        off, on = cells.get((model, w, zero, k, "off")), cells.get((model, w, zero, k, "on"))

        def pair(key: str, spec: str, off=off, on=on, zero=zero) -> str:
            b = _f(on and on[key], spec) if zero else "(ZeRO-0: off only)"
            return f"{_f(off and off[key], spec)} → {b}"

        lines.append(
            f"| {model} | {w} | {zero} | {k} | {pair('grad_reduction_passes', '.2f')} | "
            f"{pair('peak_mib', '.0f')} | {pair('step_s', '.2f')} | {pair('median_ms_per_sample', '.1f')} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], img_dir: Path) -> list[Path]:
    """PNGs: compute overhead vs k against theory; time per sample next to open_clip; peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    w1 = [r for r in rows if r["W"] == 1 and r["coalesce"] == "off"]
    models = sorted(
        {r["model"] for r in w1}, key=lambda n: next(r["params_m"] for r in w1 if r["model"] == n)
    )
    ks = sorted({r["k"] for r in w1 if r["mode"] == "cached"})

    def series(name: str, pred) -> list[tuple]:
        return sorted(
            (r["k"], r) for r in w1 if r["model"] == name and pred(r)
        )  # one point per k (the lowest ZeRO stage measured first)

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80, sharey=True)
    for ax, ckpt in zip(axes, (False, True)):
        if ks:
            label = "theory (5k-1)/(4k)" if ckpt else "theory (4k-1)/(3k)"
            ax.plot(ks, [theory(k, ckpt) for k in ks], "k--", label=label)
        for name in models:
            pts = series(
                name, lambda r, c=ckpt: r["mode"] == "cached" and r["ckpt"] == c and "compute_vs_plain" in r
            )
            if pts:
                ax.plot([k for k, _ in pts], [r["compute_vs_plain"] for _, r in pts], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (--accum-freq), m fixed")
        ax.set_title(f"activation checkpointing {'on' if ckpt else 'off'}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("compute per sample / plain step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(img_dir / "accum_compute_overhead.png")
    fig.savefig(written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=80)
    for i, name in enumerate(models):
        color = f"C{i}"
        ours = series(name, lambda r: r["mode"] == "cached" and not r["ckpt"])
        plain = series(name, lambda r: r["mode"] == "plain" and not r["ckpt"])
        oc = series(name, lambda r: r["impl"] == "open_clip" and not r["ckpt"])
        if ours:
            ax.plot(
                [k for k, _ in ours],
                [r["ms_per_sample"] for _, r in ours],
                "o-",
                color=color,
                label=f"ds_clip {name}",
            )
        if plain and ks:
            ax.axhline(plain[0][1]["ms_per_sample"], color=color, lw=0.8, ls="--")
        if oc:
            ax.plot([k for k, _ in oc], [r["ms_per_sample"] for _, r in oc], "x:", color=color, ms=9,
                    label=f"open_clip {name}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("k (--accum-freq), m fixed")
    ax.set_ylabel("ms per sample (best step; dashed: plain step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(img_dir / "accum_time_per_sample.png")
    fig.savefig(written[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8), dpi=80)
    for i, name in enumerate(models):
        color = f"C{i}"
        ours = series(name, lambda r: r["mode"] == "cached" and not r["ckpt"])
        oc = series(name, lambda r: r["impl"] == "open_clip" and not r["ckpt"])
        if ours:
            ax.plot(
                [k for k, _ in ours],
                [r["peak_mib"] for _, r in ours],
                "o-",
                color=color,
                label=f"ds_clip {name}",
            )
        if oc:
            ax.plot([k for k, _ in oc], [r["peak_mib"] for _, r in oc], "x:", color=color, ms=9,
                    label=f"open_clip {name}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (--accum-freq), m fixed")
    ax.set_ylabel("peak memory of a step, MiB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(img_dir / "accum_peak_memory.png")
    fig.savefig(written[-1])
    plt.close(fig)
    return written


# --------------------------------------------------------------------------- CLI


def _stage_arg(value: str) -> int | None:
    """--zero-stages entries: "default" (ds-clip-train's own preset choice) or a stage number."""
    if value == "default":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--zero-stages must be default, 0, 1, 2 or 3, got {value!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/bench_accum.py",
        description="Measure what --accum-freq costs (time, memory, cache, collectives) against a plain "
        "DeepSpeed step and open_clip's own trainer.",
    )
    d = BenchSettings()
    p.add_argument("--models", nargs="+", default=d.models, help="open_clip model names (also bench-small)")
    p.add_argument("--image-size", type=int, default=None, help="override every model's image size (px)")
    p.add_argument("--batch-size", type=int, default=d.micro_batch_size, help="m, per rank per micro-batch")
    p.add_argument("--k", type=int, nargs="+", default=d.accum_freqs, help="--accum-freq values")
    p.add_argument("--world-sizes", type=int, nargs="+", default=d.world_sizes, help="W, local ranks")
    p.add_argument("--zero-stages", type=_stage_arg, nargs="+", default=d.zero_stages, metavar="{default,0,1,2,3}",
                   help="ZeRO stages, one engine each; default: the preset ds-clip-train picks for W")  # fmt: skip
    p.add_argument("--coalesce", nargs="+", default=d.coalesce, metavar="{off,on}",
                   help="--coalesce-grad-reduction values, one engine each (on: ZeRO 1-3 only)")  # fmt: skip
    p.add_argument("--grad-checkpointing", choices=["off", "on", "both"], default=d.grad_checkpointing)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision)
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per mode and repeat")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per mode")
    p.add_argument("--repeats", type=int, default=d.repeats, help="fresh processes per configuration")
    p.add_argument("--open-clip", action="store_true", help="also run open_clip_train (W=1) side by side")
    p.add_argument("--open-clip-k", type=int, nargs="+", default=d.open_clip_k)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    p.add_argument("--json", type=Path, default=None, help="write raw measurements and the machine here")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                   help="render tables (and --img-dir plots) from earlier --json files; runs nothing")  # fmt: skip
    p.add_argument("--img-dir", type=Path, default=None, help="write PNG plots here")
    return p


def settings_from_args(a: argparse.Namespace) -> BenchSettings:
    def positive(flag: str, values: Sequence[int]) -> None:
        bad = [v for v in values if v < 1]
        if bad:
            raise BenchError(f"{flag} must be >= 1, got {bad[0]}")

    positive("--batch-size", [a.batch_size])
    positive("--k", a.k)
    positive("--open-clip-k", a.open_clip_k)
    positive("--world-sizes", a.world_sizes)
    positive("--steps", [a.steps])
    positive("--repeats", [a.repeats])
    positive("--threads", [a.threads])
    if a.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {a.warmup}")
    bad = [z for z in a.zero_stages if z not in (None, 0, 1, 2, 3)]
    if bad:
        raise BenchError(f"--zero-stages must be 0, 1, 2 or 3, got {bad[0]}")
    bad_c = [c for c in a.coalesce if c not in ("off", "on")]
    if bad_c:
        raise BenchError(f"--coalesce must be off or on, got {bad_c[0]!r}")
    if a.coalesce == ["on"] and 0 in a.zero_stages:
        raise BenchError(
            "--coalesce on alone with --zero-stages 0: DeepSpeed coalesces on ZeRO 1-3 only; add off"
        )
    if a.image_size is not None and a.image_size < 1:
        raise BenchError(f"--image-size must be >= 1, got {a.image_size}")
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BenchError(
                "--device cuda: CUDA is not available on this machine (torch.cuda.is_available() is False)"
            )
        if max(a.world_sizes) > torch.cuda.device_count():
            raise BenchError(f"--world-sizes {max(a.world_sizes)} > {torch.cuda.device_count()} visible GPUs")
    if a.precision == "bf16" and a.device == "cpu" and a.open_clip:
        pass  # open_clip runs amp_bf16 on the CPU; slower than fp32 there, but the same precision
    if a.open_clip and importlib.util.find_spec("pandas") is None:
        # not a ds_clip dependency: only open_clip_train (the side-by-side runs) imports it
        raise BenchError("--open-clip needs pandas (open_clip_train imports it): pip install -e '.[bench]'")
    s = BenchSettings(
        models=list(a.models),
        image_size=a.image_size,
        micro_batch_size=a.batch_size,
        accum_freqs=list(a.k),
        world_sizes=list(a.world_sizes),
        zero_stages=list(a.zero_stages),
        coalesce=list(dict.fromkeys(a.coalesce)),
        grad_checkpointing=a.grad_checkpointing,
        precision=a.precision,
        device=a.device,
        steps=a.steps,
        warmup=a.warmup,
        repeats=a.repeats,
        open_clip=a.open_clip,
        open_clip_k=list(a.open_clip_k),
        threads=a.threads,
    )
    for name in s.models:  # unknown names fail here, before any process starts
        resolve_model(name, s.image_size)
    return s


def _load_report(paths: Sequence[Path]) -> tuple[list[Measurement], list[dict]]:
    rows, machines = [], []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BenchError(f"--report {p}: cannot read ({e})") from None
        machines.append({"file": str(p), **data.get("machine", {}), "argv": data.get("argv")})
        rows += [Measurement(**r) for r in data["measurements"]]
    return rows, machines


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        if a.report:
            rows, machines = _load_report(a.report)
            agg = aggregate(rows)
            print(markdown_tables(agg))
            for m in machines:
                print(f"\n{m['file']}: {m.get('date')} load {m.get('loadavg')} argv {m.get('argv')}")
            if a.img_dir:
                for p in plot(agg, a.img_dir):
                    print(f"wrote {p}")
            return 0
        s = settings_from_args(a)
    except BenchError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    start = machine_info(s.device)
    t0 = time.perf_counter()
    rows = run_benchmark(s)
    info = {**start, "loadavg_end": list(os.getloadavg()), "wall_s": round(time.perf_counter() - t0, 1)}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "argv": list(argv if argv is not None else sys.argv[1:]),
                    "settings": asdict(s),
                    "measurements": [asdict(r) for r in rows],
                },
                indent=1,
            )  # fmt: skip
        )
    agg = aggregate(rows)
    print(markdown_tables(agg))
    print(
        f"\n{info['date']} | {info.get('cpu', platform.processor())} x{info['cpus']} | "
        f"{info.get('gpu', 'no GPU')} | load {info['loadavg']} -> {info['loadavg_end']} | {info['wall_s']} s"
    )
    if a.img_dir:
        for p in plot(agg, a.img_dir):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
