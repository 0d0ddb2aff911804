"""The model card (README.md) of an export folder, from what the run folder recorded.

A checkpoint's ``ds_clip_meta.json`` holds the model, the run's shape (W, k, m, N), the step, the precision and
the resolved settings; the run folder beside ``checkpoints/`` holds ``command.txt`` (each launch's command
line, one per line), ``eval_results.json`` (validation and zero-shot results by step) and ``metrics.csv``
(training loss by step). What the run did not record is left out of the card, never guessed. The licence is
the one field the card cannot know: the owner fills it in before sharing (the hub reads ``license:`` from the
front matter).
"""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path
from typing import Any

COMMAND_FILE = "command.txt"
LICENSE_TODO = "FILL IN before sharing"


def hub_upload_command(out: Path) -> str:
    """The hub's own one-line upload of an export folder (huggingface_hub's ``hf`` CLI; older releases:
    ``huggingface-cli upload`` with the same arguments)."""
    return f"hf upload YOUR_ORG/YOUR_MODEL {shlex.quote(str(out))} . --repo-type model"


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder of a checkpoint folder ``RUN/checkpoints/step_N`` (None for a checkpoint kept elsewhere)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def launch_command(argv: list[str]) -> str:
    """``ds-clip-train ARGS`` of one rank's command line, without the --local_rank a launcher appends."""
    args = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    return shlex.join(["ds-clip-train", *args])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _row_at(rows: list[dict], step: int) -> dict | None:
    """The row of ``step``, else the last one before it (an export of a checkpoint between evaluations)."""
    before = [r for r in rows if _num(r.get("step")) is not None and _num(r.get("step")) <= step]
    return max(before, key=lambda r: _num(r["step"])) if before else None


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt(v: Any) -> str:
    x = _num(v)
    if x is None:
        return str(v)
    return str(int(x)) if x == int(x) and abs(x) >= 1 else f"{x:.4g}"


def _data_line(s: dict) -> str:
    kind = s.get("dataset_type") or "?"
    if kind == "synthetic" or not s.get("train_data"):
        return "ds_clip's built-in synthetic captioned shapes (--dataset-type synthetic)"
    line = f"`{s['train_data']}` ({kind})"
    if s.get("train_num_samples"):
        line += f", --train-num-samples {s['train_num_samples']}"
    return line


def card_text(
    *,
    meta: dict,
    checkpoint: Path,
    fmt: str,
    weights: str,
    command: str,
    logit_scale: float | None = None,
    logit_bias: float | None = None,
    hf_class: str = "CLIPModel",
) -> str:
    """The README.md of an export of ``checkpoint`` in format ``fmt`` ("open_clip" | "transformers"; ``hf_class``:
    the transformers class, "CLIPModel" or "SiglipModel")."""
    s = meta.get("settings") or {}
    run = run_folder(checkpoint)
    step = int(meta["step"])
    siglip = bool(s["siglip"]) if "siglip" in s else logit_bias is not None  # the loss trained, not the model
    name = s.get("name") or (run.name if run else checkpoint.name)
    vis, txt = meta["model_cfg"].get("vision_cfg", {}), meta["model_cfg"].get("text_cfg", {})
    library = "transformers" if fmt == "transformers" else "open_clip"
    lines = [
        "---",
        f"# license: {LICENSE_TODO}: an SPDX id (apache-2.0, mit, ...) or other; the hub reads it here",
        f"library_name: {library}",
        "tags: [clip, ds_clip, zero-shot-image-classification]",
        "pipeline_tag: zero-shot-image-classification",
        "---",
        "",
        f"# {name}",
        "",
        f"A {'SigLIP' if siglip else 'CLIP'} model trained with ds_clip (DeepSpeed, exact cached-feature gradient "
        f"accumulation), exported at step {step} in {library} format.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| model | `{meta.get('model', '?')}` (its open_clip config at the end of this card) |",
        f"| image size | {_fmt(vis.get('image_size', '?'))} |",
        f"| context length | {_fmt(txt.get('context_length', 77))} |",
        f"| embedding size | {_fmt(meta['model_cfg'].get('embed_dim', '?'))} |",
        f"| objective | {'SigLIP (sigmoid loss)' if siglip else 'CLIP (softmax contrastive loss)'} |",
        f"| weights | {weights} (fp32) |",
    ]
    if s.get("pretrained"):
        lines.append(f"| started from | `{s['pretrained']}` |")
    if logit_scale is not None:
        lines.append(f"| logit scale | exp(logit_scale) = {_fmt(2.718281828459045**logit_scale)} |")
    if logit_bias is not None:
        kept = ""
        if fmt == "transformers":
            kept = (
                " (SiglipModel's `logit_bias`, in its logits)"
                if hf_class == "SiglipModel"
                else " (config.json `logit_bias`; CLIPModel's logits leave it out)"
            )
        lines.append(f"| logit bias | {_fmt(logit_bias)}{kept} |")
    w, k, m = meta.get("world_size"), meta.get("accum_freq"), meta.get("micro_batch_size")
    lines += [
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| data | {_data_line(s)} |",
        f"| global batch | {meta.get('global_batch_size', '?')} pairs per optimizer step "
        f"(W = {w} ranks x k = {k} micro-batches x m = {m} pairs) |",
        f"| steps | {step} (samples seen {meta.get('samples_seen', '?')}, epoch {meta.get('epoch', '?')}) |",
        f"| precision | {meta.get('precision', '?')}, DeepSpeed ZeRO stage {meta.get('zero_stage', '?')} |",
        f"| optimizer | {s.get('optimizer', '?')}, lr {_fmt(s.get('lr'))}, weight decay {_fmt(s.get('wd'))}, "
        f"warmup {s.get('warmup', '?')} steps, {s.get('lr_scheduler', '?')} schedule |",
        f"| seed | {s.get('seed', '?')} |",
    ]
    lines += ["", "## Command line", ""]
    launches = _launches(run)
    if launches:
        lines += [
            "```bash",
            *launches,
            "```",
            "",
            f"(on {w} ranks; a later line is a resume of the same run)",
        ]
    else:
        lines.append("(not recorded: the run folder has no command.txt)")
    lines += ["", "Exported with:", "", "```bash", command, "```"]
    lines += ["", "## Results", "", *_results(run, step)]
    lines += ["", "## Use", "", *_usage(fmt, hf_class)]
    lines += [
        "",
        "## Licence",
        "",
        f"{LICENSE_TODO}: the licence of these weights, which follows from the training data's terms. Set it "
        "here and as `license:` in the front matter above.",
        "",
        "## open_clip config",
        "",
        "```json",
        json.dumps(
            {"model_cfg": meta["model_cfg"], "preprocess_cfg": meta.get("preprocess_cfg") or {}}, indent=1
        ),
        "```",
        "",
    ]
    return "\n".join(lines)


def _launches(run: Path | None) -> list[str]:
    if run is None or not (run / COMMAND_FILE).is_file():
        return []
    return [ln for ln in (run / COMMAND_FILE).read_text().splitlines() if ln.strip()]


def _results(run: Path | None, step: int) -> list[str]:
    out = []
    evals = _read_json(run / "eval_results.json") if run else None
    row = _row_at(evals, step) if isinstance(evals, list) else None
    if row:
        out += [f"Validation at step {_fmt(row['step'])} (ds_clip's evaluation, docs/evaluation.md):", ""]
        out += ["| metric | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in row.items() if k != "step" and _num(v) is not None]
    else:
        out.append("No validation or zero-shot results: the run had no --val-data / zero-shot evaluation.")
    metrics = run / "metrics.csv" if run else None
    if metrics is not None and metrics.is_file():
        train_row = _row_at(list(csv.DictReader(metrics.open(newline=""))), step)
        if train_row and train_row.get("loss"):
            out += ["", f"Training loss at step {_fmt(train_row['step'])}: {_fmt(train_row['loss'])}."]
    return out


def _usage(fmt: str, hf_class: str) -> list[str]:
    if fmt == "transformers" and hf_class == "SiglipModel":
        return [
            "```python",
            "import torch",
            "from transformers import AutoModel, AutoProcessor",
            'model = AutoModel.from_pretrained("YOUR_ORG/YOUR_MODEL")        # SiglipModel',
            'processor = AutoProcessor.from_pretrained("YOUR_ORG/YOUR_MODEL")',
            "# padding='max_length', as the model was trained: its text tower pools the last position",
            'inputs = processor(text=["a photo of a cat"], images=image, return_tensors="pt", padding="max_length")',
            "probs = torch.sigmoid(model(**inputs).logits_per_image)  # SigLIP's pair probabilities",
            "```",
            "",
            "Each tower alone: `SiglipVisionModel` / `SiglipTextModel` (their `pooler_output`).",
        ]
    if fmt == "transformers":
        return [
            "```python",
            "from transformers import AutoModel, AutoProcessor",
            'model = AutoModel.from_pretrained("YOUR_ORG/YOUR_MODEL")        # CLIPModel',
            'processor = AutoProcessor.from_pretrained("YOUR_ORG/YOUR_MODEL")',
            'inputs = processor(text=["a photo of a cat"], images=image, return_tensors="pt", padding=True)',
            "out = model(**inputs)  # out.image_embeds, out.text_embeds, out.logits_per_image",
            "```",
            "",
            "Each tower alone: `CLIPVisionModelWithProjection` / `CLIPTextModelWithProjection` (or `CLIPVisionModel`).",
        ]
    return [
        "```python",
        "import open_clip",
        'model, _, preprocess = open_clip.create_model_and_transforms("hf-hub:YOUR_ORG/YOUR_MODEL")',
        'tokenizer = open_clip.get_tokenizer("hf-hub:YOUR_ORG/YOUR_MODEL")',
        "```",
    ]


def write_card(out: Path, **kwargs: Any) -> Path:
    path = Path(out) / "README.md"
    path.write_text(card_text(**kwargs))
    return path


__all__ = [
    "COMMAND_FILE",
    "LICENSE_TODO",
    "card_text",
    "hub_upload_command",
    "launch_command",
    "run_folder",
    "write_card",
]
