"""Where training numbers go on rank 0: a progress bar or plain lines, TensorBoard, CSV, W&B."""

from __future__ import annotations

import csv
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ds_clip.geometry import BatchGeometry

logger = logging.getLogger("ds_clip")


def peak_memory_mib() -> float:
    """Peak memory of this rank: ``torch.cuda.max_memory_allocated`` on its accelerator device on GPUs
    (what tensors held, not what the caching allocator reserved), this process's peak RSS on the CPU."""
    from ds_clip.distributed import device

    d = device()
    if d.type == "cuda":
        return torch.cuda.max_memory_allocated(d) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def format_line(m: dict[str, Any]) -> str:
    parts = [
        f"step {m['step']}/{m['total_steps']}",
        f"epoch {m['epoch']}",
        f"samples {m['samples_seen']}",
        f"loss {m['loss']:.4f}",
        f"logit_scale {m['logit_scale']:.2f}",
        f"lr {m['lr']:.3e}",
        f"samples/s {m['samples_per_s']:.1f} ({m['samples_per_s_per_rank']:.1f}/rank)",
        f"data {m['data_time_s']:.3f}s",
        f"step {m['step_time_s']:.3f}s",
        f"peak_mem {m['peak_mem_mib']:.0f}MiB",
    ]
    # Two kinds of skip, named apart: bad samples the loaders left out, updates a non-finite step skipped.
    # --siglip2: each term of the objective apart (a term not trained yet is NaN in the sinks, left off here).
    for key, value in m.items():
        if key.startswith("loss_") and value == value:
            parts.append(f"{key[5:]} {value:.4f}")
        elif key == "locca_regions":
            parts.append(f"regions {int(value)}")
    if m.get("skipped_samples"):
        parts.append(f"skipped_samples {m['skipped_samples']}")
    if m.get("skipped_steps"):
        parts.append(f"skipped_steps {m['skipped_steps']}")
    return " | ".join(parts)


class MetricsWriter:
    """Rank 0 only: console (tqdm on a terminal, plain lines otherwise), TensorBoard, CSV, W&B."""

    def __init__(
        self, run_dir: Path, report_to: list[str], total_steps: int, initial_step: int, config: dict
    ):
        self.tb = self.csv_file = self.csv = self.wandb = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if "csv" in report_to:
            path = run_dir / "metrics.csv"
            new = not path.exists()
            self.csv_file = path.open("a", newline="")
            self.csv_new = new
        if "wandb" in report_to:
            self.wandb = start_wandb(run_dir, config)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True)

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, m: dict[str, Any]) -> None:
        line = format_line(m)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {m['loss']:.4f} samples/s {m['samples_per_s']:.1f}")
            self.bar.write(line)
        else:
            print(line, flush=True)
        scalars = {
            k: v for k, v in m.items() if isinstance(v, (int, float)) and k not in ("step", "total_steps")
        }
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(f"train/{k}", v, m["step"])
            self.tb.flush()
        if self.csv_file is not None:
            if self.csv is None:
                self.csv = csv.DictWriter(self.csv_file, fieldnames=list(m.keys()))
                if self.csv_new:
                    self.csv.writeheader()
            self.csv.writerow(m)
            self.csv_file.flush()
        if self.wandb is not None:
            # open_clip's names (train/loss, train/scale, train/samples_per_second, ...) and its "step" key.
            self.wandb.log(
                {**{wandb_name(k): v for k, v in scalars.items()}, "step": m["step"]}, step=m["step"]
            )

    def scalar_sink(self):
        """What the evaluator writes its val/* scalars to: TensorBoard, and W&B under open_clip's names."""
        if self.wandb is None:
            return self.tb
        return _ScalarFanOut(self.tb, self.wandb)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.wandb is not None:
            self.wandb.finish()


# Our log row's keys -> open_clip_train's W&B names (open_clip_train/train.py); others keep their key.
WANDB_TRAIN_NAMES = {
    "loss": "loss",
    "logit_scale": "scale",
    "lr": "lr",
    "samples_per_s": "samples_per_second",
    "samples_per_s_per_rank": "samples_per_second_per_gpu",
    "data_time_s": "data_time",
    "step_time_s": "batch_time",
}
# The evaluator's metric names -> open_clip's (its val/* and zero-shot names); others keep their key.
WANDB_VAL_NAMES = {
    "val_loss": "clip_val_loss",
    "val_samples": "num_samples",
    **{
        f"{d}_R@{k}": f"{name}_R@{k}"
        for d, name in (("i2t", "image_to_text"), ("t2i", "text_to_image"))
        for k in (1, 5, 10)
    },  # fmt: skip
    "i2t_median_rank": "image_to_text_median_rank",
    "t2i_median_rank": "text_to_image_median_rank",
}


def wandb_name(key: str) -> str:
    """open_clip_train's W&B name of one of our train row keys: train/<its name>."""
    return f"train/{WANDB_TRAIN_NAMES.get(key, key)}"


def wandb_run_id(name: str) -> str:
    """The W&B run id of a run folder: its name, as open_clip does (id=args.name), in the characters W&B
    allows, so that a resumed run (--resume) logs into the same W&B run."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:128]


def start_wandb(run_dir: Path, config: dict):
    """wandb.init as open_clip_train calls it: project, name and id from the run name, notes, the settings as
    config, resume="allow" when the run resumes. WANDB_MODE=offline (the tests) keeps it on disk under
    run_dir/wandb; `wandb sync` uploads it later."""
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError("--report-to wandb needs the wandb package: pip install 'ds_clip[wandb]'") from exc
    return wandb.init(
        project=config.get("wandb_project_name") or "ds_clip",
        name=run_dir.name,
        id=wandb_run_id(run_dir.name),
        notes=config.get("wandb_notes") or None,
        tags=[],
        resume="allow" if config.get("resume") else None,
        config=config,
        dir=str(run_dir),
    )


class _ScalarFanOut:
    """add_scalar/flush to TensorBoard (when on) and W&B (val/<open_clip's name>), for the evaluator."""

    def __init__(self, tb, run) -> None:
        self.tb, self.run = tb, run

    def add_scalar(self, name: str, value: float, step: int) -> None:
        if self.tb is not None:
            self.tb.add_scalar(name, value, step)
        section, _, key = name.partition("/")
        self.run.log({f"{section}/{WANDB_VAL_NAMES.get(key, key)}": value, "step": step}, step=step)

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()


class StepMeter:
    """Owns ``--log-every-n-steps``: times the steps of one logging window and turns them into a log row.

    Samples/s counts every pair of an applied step: k micro-batches x m pairs x W ranks (open_clip once
    shipped without the factor k). The loss and logit_scale stay device tensors until a row is made: the
    only host reads are at log steps.
    """

    def __init__(self, *, every_n_steps: int, total_steps: int, geometry: BatchGeometry) -> None:
        self.every_n_steps, self.total_steps = every_n_steps, total_steps
        self.global_batch, self.world_size = geometry.global_batch, geometry.world_size
        self.loss = self.logit_scale = self.lr = None
        self.parts: dict | None = None
        self._reset()

    def _reset(self) -> None:
        self.samples, self.step_time, self.data_time = 0, 0.0, 0.0
        self.start = time.perf_counter()

    def record(self, result, *, data_time: float, step_time: float) -> None:
        self.step_time += step_time
        self.data_time += data_time
        if not result.skipped:
            self.samples += self.global_batch
            self.loss, self.logit_scale = result.loss, result.logit_scale
            # The LR the step trained at (not the optimizer's LR after it: that is already the next step's).
            self.lr = result.lr
            self.parts = getattr(result, "parts", None)

    def should_log(self, step: int) -> bool:
        return step % self.every_n_steps == 0 or step == self.total_steps

    def row(self, *, step: int, epoch: int, skipped_samples: int, skipped_steps: int) -> dict[str, Any]:
        """The log row of the window ending at ``step``; starts the next window. Its ``lr`` is the one step
        ``step`` trained at, the one value the console line, TensorBoard, CSV and W&B all show."""
        elapsed = time.perf_counter() - self.start
        steps = max(1, round(self.samples / self.global_batch))
        row = {
            "step": step,
            "total_steps": self.total_steps,
            "epoch": epoch,
            "samples_seen": step * self.global_batch,
            "loss": self.final_loss(),  # host sync: log steps only
            "logit_scale": float("nan") if self.logit_scale is None else float(self.logit_scale),
            "lr": float("nan") if self.lr is None else self.lr,
            "samples_per_s": self.samples / elapsed,
            "samples_per_s_per_rank": self.samples / elapsed / self.world_size,
            "data_time_s": self.data_time / steps,
            "step_time_s": self.step_time / steps,
            "peak_mem_mib": peak_memory_mib(),
            "skipped_samples": skipped_samples,
            "skipped_steps": skipped_steps,
        }
        if self.parts is not None:  # host reads at log steps only
            row.update({k: float(v) for k, v in self.parts.items()})
        self._reset()
        return row

    def final_loss(self) -> float:
        return float("nan") if self.loss is None else float(self.loss)
