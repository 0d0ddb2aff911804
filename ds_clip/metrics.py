"""Where training numbers go on rank 0: a progress bar or plain lines, TensorBoard, CSV, W&B."""

from __future__ import annotations

import csv
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import torch

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
    if m.get("skipped_samples"):
        parts.append(f"skipped {m['skipped_samples']}")
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
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("--report-to wandb needs the wandb package: pip install wandb") from exc
            self.wandb = wandb.init(project="ds_clip", name=run_dir.name, config=config, dir=str(run_dir))
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
            self.wandb.log(scalars, step=m["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.wandb is not None:
            self.wandb.finish()
