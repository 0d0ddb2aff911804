"""The model card (README.md) of an export folder, from what the run folder recorded.

A checkpoint's ``ds_clip_meta.json`` holds the model, the run's shape (W, k, m, N), the step, the precision and
the resolved settings; the run folder beside ``checkpoints/`` holds ``command.txt`` (each launch's command
line, one per line), ``eval_results.json`` (validation and zero-shot results by step) and ``metrics.csv``
(training loss by step). What the run did not record is left out of the card, never guessed. The licence is
the one field the card cannot know: the owner fills it in before sharing (the hub reads ``license:`` from the
front matter).

The card is written to be published, so the training data and command lines it quotes are redacted (``redact``):
header values (``curl -H 'Authorization: Bearer ...'``, ``--header``), a URL's user-info (``https://user:pw@``),
signed query strings (``X-Amz-Signature``, ``X-Goog-Signature``, SAS ``sig``, ``token``, ...), ``-u user:pw`` and
secret-named variables (``AWS_SECRET_ACCESS_KEY=...``). ``command.txt`` itself stays whole in the run folder.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
from pathlib import Path
from typing import Any

from ds_clip.siglip2.defaults import SILC_WEIGHT, TIPS_WEIGHT, siglip2_selfsup_weights

COMMAND_FILE = "command.txt"
REDACTED = "REDACTED"
LICENSE_TODO = "FILL IN before sharing"
EMA_PREFIX = "ema/"  # eval_results.json: the weight EMA's metrics (ds_clip.evaluate.evaluator's views)
_REDACTED_NOTE = (
    "Secrets in the training data and command lines of this card (header values, URL user-info, signed query strings, "
    f"passwords, secret-named variables) are shown as {REDACTED}; the run folder's command.txt keeps them whole."
)


def hub_upload_command(out: Path) -> str:
    """The hub's own one-line upload of an export folder (huggingface_hub's ``hf`` CLI; older releases:
    ``huggingface-cli upload`` with the same arguments)."""
    return f"hf upload YOUR_ORG/YOUR_MODEL {shlex.quote(str(out))} . --repo-type model"


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder of a checkpoint folder ``RUN/checkpoints/step_N`` (None for a checkpoint kept elsewhere)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


# The shell comment after each launch's line in command.txt: the W and k (and m) that launch trained with, which
# its own arguments do not say (the launcher picks W; --global-batch-size can derive k).
_GEOMETRY = re.compile(r"\s+# W = (\d+) ranks? x k = (\d+)(?: x m = (\d+))?\s*$")


def launch_command(argv: list[str], geometry: Any = None) -> str:
    """``ds-clip-train ARGS`` of one rank's command line, without the --local_rank a launcher appends; with
    ``geometry`` (a BatchGeometry), followed by a shell comment naming the launch's W, k and m."""
    args = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    line = shlex.join(["ds-clip-train", *args])
    if geometry is not None:
        line += (
            f"  # W = {geometry.world_size} {_ranks(geometry.world_size)} x k = {geometry.accum_freq} "
            f"x m = {geometry.micro_batch_size}"
        )
    return line


def _ranks(n: Any) -> str:
    return "rank" if n == 1 else "ranks"


# What ``redact`` hides: values that grant access, wherever a command or a data source can carry them.
_SECRET_PARAM = (
    r"[^=&\s'\"]*(?:signature|sig|token|credential|secret|password|passwd|key|auth|policy)[^=&\s'\"]*"
)
_REDACTIONS = (
    # curl/wget headers: -H 'Authorization: Bearer x', --header "X-Api-Key: x", --header=Name:x (the name stays)
    (
        re.compile(r"""(?i)((?:^|\s)(?:-H|--header)(?:\s+|=)(['"]?)[A-Za-z0-9_-]+:\s*)((?:(?!\2).)+|\S+)"""),
        rf"\1{REDACTED}",
    ),
    # a bare "Authorization: <scheme> <value>" or "Bearer <value>" elsewhere
    (re.compile(r"(?i)\b(authorization:\s*)(?:(?:bearer|basic|token)\s+)?[^\s'\"]+"), rf"\1{REDACTED}"),
    (re.compile(r"(?i)\b(bearer\s+)(?!REDACTED)[^\s'\"]+"), rf"\1{REDACTED}"),
    # user-info of a URL: scheme://user:password@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@'\"]+@"), rf"\1{REDACTED}@"),
    # signed query strings: the value of each parameter named like a signature, credential, token or key
    (re.compile(rf"(?i)([?&]{_SECRET_PARAM}=)[^&\s'\"#]*"), rf"\1{REDACTED}"),
    # curl -u user:password, --user user:password
    (re.compile(r"""(?i)((?:^|\s)(?:-u|--user)(?:\s+|=)(['"]?))[^\s'"]+"""), rf"\1{REDACTED}"),
    # NAME=value of an environment variable named as a secret (AWS_SECRET_ACCESS_KEY=..., HF_TOKEN=...)
    (
        re.compile(r"\b([A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|KEY|CREDENTIALS?)[A-Z0-9_]*=)[^\s'\"]+"),
        rf"\1{REDACTED}",
    ),
)


def redact(text: str) -> str:
    """``text`` (a data source or a command line) with the values that grant access replaced by REDACTED (the
    module docstring lists them); everything else as it was."""
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


def _redact_line(line: str) -> str:
    """One command.txt line redacted argument by argument (a pipe: source is one quoted argument holding a whole
    command: its own quotes are seen unquoted), quoted again as the shell reads it; the W/k comment kept."""
    m = _GEOMETRY.search(line)
    body, comment = (line[: m.start()], line[m.start() :]) if m else (line, "")
    try:
        return shlex.join(redact(arg) for arg in shlex.split(body)) + comment
    except ValueError:  # not shell-quoted as ds_clip writes it: redact the text as it is
        return redact(body) + comment


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
    line = f"`{redact(str(s['train_data']))}` ({kind})"
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
    ema: bool = False,
    image_width: int | None = None,
    left_out: int = 0,
) -> str:
    """The README.md of an export of ``checkpoint`` in format ``fmt`` ("open_clip" | "transformers"; ``hf_class``:
    the transformers class, "CLIPModel" or "SiglipModel"; ``ema``: the weights are the run's weight EMA). A
    ``--siglip2`` run's card names its objective with the weights it trained with (``image_width``: the image
    tower's, for the defaults of the self-supervised terms) and says the export holds the encoders only
    (``left_out``: the parameters of its training-time parts the export left out)."""
    s = meta.get("settings") or {}
    run = run_folder(checkpoint)
    step = int(meta["step"])
    siglip = bool(s["siglip"]) if "siglip" in s else logit_bias is not None  # the loss trained, not the model
    siglip2 = bool(s.get("siglip2"))
    if siglip2:
        objective = siglip2_objective(s, image_width or _config_width(meta["model_cfg"]))
    else:
        objective = "SigLIP (sigmoid loss)" if siglip else "CLIP (softmax contrastive loss)"
    name = s.get("name") or (run.name if run else checkpoint.name)
    vis, txt = meta["model_cfg"].get("vision_cfg", {}), meta["model_cfg"].get("text_cfg", {})
    library = "transformers" if fmt == "transformers" else "open_clip"
    # transformers' zero-shot pipeline takes a softmax over a CLIPModel's logits: SigLIP-trained towers exported as
    # CLIPModel score each pair with a sigmoid and the bias instead (the Use section), so no pipeline tag offers it.
    sigmoid_clip = siglip and fmt == "transformers" and hf_class == "CLIPModel"
    front = (
        ["tags: [clip, siglip, ds_clip]"]
        if sigmoid_clip
        else [
            "tags: [clip, ds_clip, zero-shot-image-classification]",
            "pipeline_tag: zero-shot-image-classification",
        ]
    )
    lines = [
        "---",
        f"# license: {LICENSE_TODO}: an SPDX id (apache-2.0, mit, ...) or other; the hub reads it here",
        f"library_name: {library}",
        *front,
        "---",
        "",
        f"# {name}",
        "",
        f"A {'SigLIP 2' if siglip2 else 'SigLIP' if siglip else 'CLIP'} model trained with ds_clip (DeepSpeed, "
        f"exact cached-feature gradient accumulation), exported at step {step} in {library} format"
        + (": its image and text encoders, as SigLIP 2 is published." if siglip2 else "."),
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| model | `{meta.get('model', '?')}` (its open_clip config at the end of this card) |",
        f"| image size | {_fmt(vis.get('image_size', '?'))} |",
        f"| context length | {_fmt(txt.get('context_length', 77))} |",
        f"| embedding size | {_fmt(meta['model_cfg'].get('embed_dim', '?'))} |",
        f"| objective | {objective} |",
        f"| weights | {weights} (fp32) |",
    ]
    if siglip2:
        parts = f"; {left_out:,} parameters" if left_out else ""
        lines.append(
            "| exported parts | the image and text encoders only (with the logit scale and bias): SigLIP 2's "
            f"training-time parts (the LocCa decoder, the self-supervised heads, the mask token{parts}) are left "
            "out, as in the paper |"
        )
    if s.get("pretrained"):
        lines.append(f"| started from | `{redact(str(s['pretrained']))}` |")
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
    launches = _launches(run)
    resumed = len(launches) > 1
    lines += [
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| data | {_data_line(s)} |",
        f"| global batch | {meta.get('global_batch_size', '?')} pairs per optimizer step "
        f"(W = {w} {_ranks(w)} x k = {k} micro-batches x m = {m} pairs{' at this checkpoint' if resumed else ''}) |",
        f"| steps | {step} (samples seen {meta.get('samples_seen', '?')}, epoch {meta.get('epoch', '?')}) |",
        f"| precision | {meta.get('precision', '?')}, DeepSpeed ZeRO stage {meta.get('zero_stage', '?')} |",
        f"| optimizer | {s.get('optimizer', '?')}, lr {_fmt(s.get('lr'))}, weight decay {_fmt(s.get('wd'))}, "
        f"warmup {s.get('warmup', '?')} steps, {s.get('lr_scheduler', '?')} schedule |",
        f"| seed | {s.get('seed', '?')} |",
    ]
    lines += ["", "## Command line", ""]
    if launches:
        shown = [_redact_line(ln) for ln in launches]
        lines += ["```bash", *shown, "```", ""]
        if all(_GEOMETRY.search(ln) for ln in launches):
            lines.append("(each line one launch, with the W ranks and k micro-batches it trained on; a later line is a resume of the same run)")  # fmt: skip
        else:  # a run folder written before command.txt recorded each launch's W and k
            lines.append(f"(a later line is a resume of the same run; the exported checkpoint was saved on {w} {_ranks(w)})")  # fmt: skip
    else:
        lines.append("(not recorded: the run folder has no command.txt)")
    lines += ["", "Exported with:", "", "```bash", _redact_line(command), "```"]
    quoted = [*launches, command, str(s.get("train_data") or ""), str(s.get("pretrained") or "")]
    if any(redact(text) != text for text in quoted):
        lines += ["", _REDACTED_NOTE]
    lines += ["", "## Results", "", *_results(run, step, ema=ema)]
    lines += ["", "## Use", "", *_usage(fmt, hf_class, sigmoid_clip)]
    if fmt == "transformers":
        lines += ["", *_tokenizer_note(hf_class)]
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


def siglip2_objective(s: dict, image_width: int | None) -> str:
    """The card's objective of a --siglip2 run from its flat settings ``s``, each weight as trained: an unset SILC
    or TIPS weight is the paper's default for an image tower of ``image_width`` (ds_clip.siglip2.defaults)."""
    silc, tips = s.get("siglip2_silc_weight"), s.get("siglip2_tips_weight")
    if image_width is not None:
        silc, tips = siglip2_selfsup_weights(silc, tips, image_width)
    return (
        f"SigLIP 2 objective: sigmoid loss + LocCa decoder (weight {_fmt(s.get('siglip2_locca_weight', 1.0))}, "
        f"parallel share {_fmt(s.get('siglip2_parallel_fraction', 0.5))}) + SILC self-distillation (weight "
        f"{_weight(silc, SILC_WEIGHT)}) and TIPS masked prediction (weight {_weight(tips, TIPS_WEIGHT)}) from "
        f"{_fmt(100 * float(s.get('siglip2_selfsup_start', 0.8)))}% of training (teacher momentum "
        f"{_fmt(s.get('siglip2_teacher_momentum', 0.996))})"
    )


def _weight(value: float | None, paper: float) -> str:
    """A weight as trained, or (image tower width unknown) the default it stood for."""
    return _fmt(value) if value is not None else f"{_fmt(paper)} x the model-size factor"


def _config_width(model_cfg: dict) -> int | None:
    """The width of an open_clip ViT image tower from its config (open_clip's default 768); None for a timm or
    ResNet tower, whose width the config does not hold."""
    v = model_cfg.get("vision_cfg") or {}
    if v.get("timm_model_name") or isinstance(v.get("layers"), (list, tuple)):
        return None
    return int(v.get("width", 768))


def _launches(run: Path | None) -> list[str]:
    if run is None or not (run / COMMAND_FILE).is_file():
        return []
    return [ln for ln in (run / COMMAND_FILE).read_text().splitlines() if ln.strip()]


def _results(run: Path | None, step: int, *, ema: bool = False) -> list[str]:
    """The evaluation at ``step`` (or the last before it). A run with --ema-decay evaluated both weights (the
    EMA's metrics prefixed ``ema/``): the exported ones come first, each row saying whose they are."""
    out = []
    evals = _read_json(run / "eval_results.json") if run else None
    row = _row_at(evals, step) if isinstance(evals, list) else None
    if row:
        values = {k: v for k, v in row.items() if k != "step" and _num(v) is not None}
        out += [f"Validation at step {_fmt(row['step'])} (ds_clip's evaluation, docs/evaluation.md):", ""]
        averaged = {k.removeprefix(EMA_PREFIX): v for k, v in values.items() if k.startswith(EMA_PREFIX)}
        if averaged:
            live = {k: v for k, v in values.items() if not k.startswith(EMA_PREFIX)}
            groups = [("weight EMA", averaged), ("live weights", live)]
            if not ema:
                groups.reverse()
            out += ["| weights | metric | value |", "|---|---|---|"]
            for i, (who, metrics) in enumerate(groups):
                label = f"{who} (exported)" if i == 0 else who
                out += [f"| {label} | {k} | {_fmt(v)} |" for k, v in metrics.items()]
        else:
            out += ["| metric | value |", "|---|---|"]
            out += [f"| {k} | {_fmt(v)} |" for k, v in values.items()]
    else:
        out.append("No validation or zero-shot results: the run had no --val-data / zero-shot evaluation.")
    metrics = run / "metrics.csv" if run else None
    if metrics is not None and metrics.is_file():
        train_row = _row_at(list(csv.DictReader(metrics.open(newline=""))), step)
        if train_row and train_row.get("loss"):
            out += ["", f"Training loss at step {_fmt(train_row['step'])}: {_fmt(train_row['loss'])}."]
    return out


def _usage(fmt: str, hf_class: str, sigmoid_clip: bool = False) -> list[str]:
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
    if sigmoid_clip:
        return [
            "```python",
            "import torch",
            "from transformers import AutoModel, AutoProcessor",
            'model = AutoModel.from_pretrained("YOUR_ORG/YOUR_MODEL")        # CLIPModel, trained with the SigLIP loss',
            'processor = AutoProcessor.from_pretrained("YOUR_ORG/YOUR_MODEL")',
            'inputs = processor(text=["a photo of a cat"], images=image, return_tensors="pt", padding=True)',
            "out = model(**inputs)  # out.image_embeds, out.text_embeds, out.logits_per_image",
            "probs = torch.sigmoid(out.logits_per_image + model.config.logit_bias)  # SigLIP's pair probabilities",
            "```",
            "",
            "The model was trained with SigLIP's sigmoid loss: each image-text pair has its own probability, "
            "sigmoid(logits_per_image + logit_bias). transformers' zero-shot-image-classification pipeline takes a "
            "softmax over a CLIPModel's logits instead, so this card offers no pipeline; ranking the texts by "
            "`logits_per_image` gives the same order.",
            "",
            "Each tower alone: `CLIPVisionModelWithProjection` / `CLIPTextModelWithProjection` (or `CLIPVisionModel`).",
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


def _tokenizer_note(hf_class: str) -> list[str]:
    """What the exported tokenizer does not do that open_clip's does, and the one call that makes their ids equal."""
    cleaning = (
        "collapses whitespace and lower-cases (its normalizer)"
        if hf_class == "CLIPModel"
        else "applies open_clip's `clean` step (whitespace, case, punctuation; its normalizers)"
    )
    lines = [
        "### Tokenizer",
        "",
        f"The tokenizer has open_clip's vocabulary, ids and padding, and {cleaning}, but not open_clip's "
        "`basic_clean`: ftfy's `fix_text` (mojibake such as `cafÃ©`, curly quotes, ligatures, full-width forms, "
        "control characters) and `html.unescape` (entities such as `&amp;`, `&#39;`). Captions that these change get "
        "other ids than in training; all others (emoji, CJK, accents included) get the same ids. This call makes "
        "them equal for every caption:",
        "",
        "```python",
        "from open_clip.tokenizer import basic_clean  # pip install open_clip_torch (it brings ftfy)",
        "inputs = processor(text=[basic_clean(t) for t in texts], ...)",
        "```",
    ]
    if hf_class == "CLIPModel":  # the pad token is "!" (id 0, open_clip's padding)
        lines += [
            "",
            'The padding token is open_clip\'s, "!" (id 0); the saved `split_special_tokens` setting keeps a "!" in a '
            "caption an ordinary token from transformers 4.42 on. transformers 4.40 and 4.41 cannot split special "
            'tokens in this (fast) tokenizer and read it as padding: use 4.42 or later for captions with a "!".',
        ]
    return lines


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
    "redact",
    "run_folder",
    "siglip2_objective",
    "write_card",
]
