"""Rank 0's record of an evaluation: the log line, TensorBoard, val_metrics.csv and eval_results.json."""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

from ds_clip.evaluate.metrics import FOLDER_METRIC, IMAGENET_METRICS, RECALL_KS

logger = logging.getLogger("ds_clip")


RESULTS_FILE = "eval_results.json"
"""Every evaluation of the run, a row per step (what a relaunch reads to know the final one finished)."""


def format_line(step: int, m: dict[str, float]) -> str:
    parts = [f"val step {step}", f"samples {int(m.get('val_samples', 0))}"]
    if "val_loss" in m:
        parts.append(f"loss {m['val_loss']:.4f}")
    for d in ("i2t", "t2i"):
        if all(f"{d}_R@{k}" in m for k in RECALL_KS):
            parts.append(f"{d} R@1/5/10 " + "/".join(f"{m[f'{d}_R@{k}']:.3f}" for k in RECALL_KS))
            parts.append(f"{d} medR {m[f'{d}_median_rank']:.0f}")
    if "zeroshot_top1" in m:
        parts.append(f"zeroshot top1 {m['zeroshot_top1']:.3f}")
    for name in (*IMAGENET_METRICS.values(), FOLDER_METRIC):
        if f"{name}-top5" in m:
            parts.append(f"{name} top1/top5 {m[f'{name}-top1']:.3f}/{m[f'{name}-top5']:.3f}")
        elif f"{name}-top1" in m:  # fewer than 5 classes
            parts.append(f"{name} top1 {m[f'{name}-top1']:.3f}")
    return " | ".join(parts)


def report(run_dir: Path, step: int, metrics: dict[str, float], tb_writer=None) -> None:
    """Rank 0: log line, TensorBoard (val/*), run_dir/val_metrics.csv, run_dir/eval_results.json (all evaluations)."""
    logger.info(format_line(step, metrics))
    for prefix in sorted(
        {k.split("/", 1)[0] + "/" for k in metrics if "/" in k}
    ):  # other weights: a line each
        logger.info(
            "%s %s",
            prefix,
            format_line(step, {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}),
        )
    row = {"step": step, **metrics}
    if tb_writer is not None:
        for k, v in metrics.items():
            tb_writer.add_scalar(f"val/{k}", v, step)
        tb_writer.flush()
    csv_path = run_dir / "val_metrics.csv"
    rows = list(csv.DictReader(csv_path.open(newline=""))) if csv_path.exists() else []
    fields = list(rows[0]) if rows else []
    if [k for k in row if k not in fields]:
        # Evaluations on different cadences (--val-frequency, --zeroshot-frequency) log different metrics: a
        # new one widens the table (rewritten; earlier rows get empty cells) so every row stays readable.
        fields += [k for k in row if k not in fields]
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    with csv_path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=fields).writerow(row)
    json_path = run_dir / RESULTS_FILE
    history = json.loads(json_path.read_text()) if json_path.exists() else []
    history = [h for h in history if h.get("step") != step] + [row]
    tmp = json_path.with_name(".eval_results.json.tmp")
    tmp.write_text(json.dumps(history, indent=1))
    os.replace(tmp, json_path)
