"""Evaluation: val loss, image<->text retrieval and zero-shot classification, on the engine or an export.

    ds-clip-eval OUT --val-data synthetic --zeroshot-classes classes.json      # an exported folder
    ds-clip-eval ViT-B-32 --pretrained OUT/open_clip_model.safetensors --val-data 'val/{0..3}.tar'
    ds-clip-eval ViT-B-32 --pretrained laion2b_s34b_b79k --val-data ...      # an open_clip tag (docs/pretrained.md)

During training (``--val-data``, ``--val-every-n-steps``) every rank takes part: rank r embeds the
samples with index i = r (mod W), the embeddings are gathered with their indices, so every sample
counts exactly once whatever W is, and every rank runs the same number of forward passes (ZeRO-3
gathers parameters in forward: a rank that ran out of samples repeats a padding batch).

Metrics are over the whole validation set at once, so they do not depend on W or the batch size:
- ``val_loss``: the CLIP (or SigLIP) loss of all N_val pairs as one batch;
- ``i2t_R@{1,5,10}``, ``t2i_R@{1,5,10}``, ``*_median_rank`` (1-based): the rank of the true partner
  among all N_val candidates; ties are broken by sample index (as a stable sort would), so a model
  that maps everything to one point scores chance, not 100%;
- ``zeroshot_top1`` / ``zeroshot_top5``: class = argmax of the image against the mean of the
  normalised template embeddings of each class (open_clip's classifier). A sample's label is its
  webdataset ``cls`` (integer) if present, else the one class name found as whole words in its caption;
  samples with no or several matches are left out (``zeroshot_samples`` says how many count).

``--val-data synthetic`` renders held-out pairs of the built-in dataset (indices from 2**40 on, which
training never reaches); webdataset shards are read in order, undecoded samples of other ranks skipped.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import logging
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ds_clip.checkpoint import epochs_done_at, on_cadence
from ds_clip.config import (
    DataSettings,
    EvalSectionSettings,
    SettingsError,
    TrainSettings,
    add_flags,
    check_data,
    check_eval,
    imagenet_class_folders,
)
from ds_clip.distributed import all_gather_rows, all_reduce_max, all_reduce_sum, to_device
from ds_clip.errors import UserError

logger = logging.getLogger("ds_clip")

SYNTHETIC = "synthetic"
SYNTHETIC_VAL_OFFSET = 2**40
DEFAULT_SYNTHETIC_VAL_SAMPLES = 512
RECALL_KS = (1, 5, 10)
_CHUNK = 1024  # rows of the similarity matrix held at once: memory O(chunk * N_val)

Forward = Callable[..., dict]


class EvalError(UserError):
    """Bad evaluation input (a flag, file or pattern); the message names it."""


# ds-clip-eval's own default: it runs no backward, so a larger batch fits.
EVAL_BATCH_SIZE = 64


@dataclass
class EvalSettings:
    """What one evaluation reads. Not a second definition of flags: the trainer builds it from its
    settings (`from_settings`: the `eval` section plus the data and batch values it shares) and ds-clip-eval
    from the same fields' flags (`build_parser`); the defaults below are those fields' defaults, but for
    ds-clip-eval's larger batch."""

    val_data: str
    """--val-data."""
    val_num_samples: int | None = EvalSectionSettings.val_num_samples
    """--val-num-samples."""
    batch_size: int = EVAL_BATCH_SIZE
    """--batch-size: pairs per forward pass per rank."""
    zeroshot_classes: str | None = EvalSectionSettings.zeroshot_classes
    """--zeroshot-classes."""
    seed: int = DataSettings.seed
    """--seed: of the synthetic validation pairs."""
    image_size: int = 64
    """Side at which synthetic images are rendered: the model's image size (its preprocess resizes)."""
    image_key: str = DataSettings.image_key
    """--image-key."""
    caption_key: str = DataSettings.caption_key
    """--caption-key."""

    @classmethod
    def from_settings(cls, s: TrainSettings, image_size: int) -> EvalSettings | None:
        """The evaluation of a training run (None without --val-data); evaluates m pairs per pass."""
        if not s.eval.val_data:
            return None
        return cls(
            val_data=s.eval.val_data,
            val_num_samples=s.eval.val_num_samples,
            batch_size=s.optim.batch_size,
            zeroshot_classes=s.eval.zeroshot_classes,
            seed=s.data.seed,
            image_size=image_size,
            image_key=s.data.image_key,
            caption_key=s.data.caption_key,
        )


# ------------------------------------------------------------------------------------------- zero-shot


def load_zeroshot(path: str) -> tuple[list[str], list[Callable[[str], str]]]:
    """Class names and prompt templates from ``path``.

    JSON: {"classnames": [...], "templates": ["a photo of a {c}.", ...] | "openai" | "simple"}; a text file:
    one class name a line, open_clip's SIMPLE_IMAGENET_TEMPLATES.
    """
    import open_clip

    p = Path(path).expanduser()
    if not p.is_file():
        raise EvalError(f"--zeroshot-classes {path!r}: no such file")
    templates: Any = "simple"
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text())
            classnames = [str(c) for c in data["classnames"]]
            templates = data.get("templates", "simple")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EvalError(
                f"--zeroshot-classes {path}: expected {{'classnames': [...], 'templates': [...]}}"
            ) from exc
    else:
        classnames = [line.strip() for line in p.read_text().splitlines() if line.strip()]
    if not classnames:
        raise EvalError(f"--zeroshot-classes {path}: no class names")
    if templates == "simple":
        fns = list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    elif templates == "openai":
        fns = list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    elif (
        isinstance(templates, list)
        and templates
        and all(isinstance(t, str) and "{c}" in t for t in templates)
    ):
        fns = [(lambda c, t=t: t.replace("{c}", c)) for t in templates]
    else:
        raise EvalError(
            f"--zeroshot-classes {path}: templates must be 'simple', 'openai' or strings with {{c}}"
        )
    return classnames, fns


def label_from_caption(caption: str, classnames: list[str]) -> int:
    """Index of the one class name found as whole words in ``caption``; -1 for none or several."""
    low = caption.lower()
    hits = [i for i, c in enumerate(classnames) if re.search(rf"\b{re.escape(c.lower())}\b", low)]
    return hits[0] if len(hits) == 1 else -1


# ------------------------------------------------------------------------------------------------ data


class _SyntheticVal(torch.utils.data.Dataset):
    """Held-out pairs of the built-in dataset: (index, image, tokens, label)."""

    def __init__(self, s: EvalSettings, indices: list[int], preprocess, tokenizer, classnames) -> None:
        self.s, self.indices, self.preprocess, self.tokenizer, self.classnames = (
            s, indices, preprocess, tokenizer, classnames
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        from ds_clip.data.synthetic import render_pair

        idx = self.indices[i]
        image, caption = render_pair(self.s.seed, SYNTHETIC_VAL_OFFSET + idx, self.s.image_size)
        label = label_from_caption(caption, self.classnames) if self.classnames else -1
        return idx, self.preprocess(image), torch.as_tensor(self.tokenizer([caption])[0]), label


def _wds_samples(s: EvalSettings, rank: int, world: int, preprocess, tokenizer, classnames) -> Iterator:
    from ds_clip.data.wds import SkipCounter, decode_sample, expand_urls, iter_shard

    image_exts = tuple(k.strip().lower() for k in s.image_key.split(";") if k.strip())
    caption_exts = tuple(k.strip().lower() for k in s.caption_key.split(";") if k.strip())
    counter = SkipCounter()
    index = 0
    for url in expand_urls(s.val_data, "--val-data"):
        for raw in iter_shard(url, counter):
            if s.val_num_samples is not None and index >= s.val_num_samples:
                return
            mine = index % world == rank
            index += 1
            if not mine:
                continue
            out = decode_sample(
                raw,
                image_exts=image_exts,
                caption_exts=caption_exts,
                preprocess=preprocess,
                tokenizer=tokenizer,
            )
            if isinstance(out, str):
                counter.add(out, url, raw.key)
                continue
            label = -1
            if "cls" in raw.data:
                try:
                    label = int(raw.data["cls"].decode().strip())
                except ValueError:
                    label = -1
            elif classnames:
                label = label_from_caption(
                    raw.data[next(e for e in caption_exts if e in raw.data)].decode(), classnames
                )
            yield index - 1, out[0], out[1], label
    pending, messages = counter.take()
    for m in messages:
        logger.warning("val: %s", m)
    if pending:
        logger.warning("val rank %d: skipped %s", rank, pending)


def iter_val_batches(
    s: EvalSettings,
    *,
    rank: int,
    world: int,
    preprocess,
    tokenizer,
    classnames: list[str] | None,
    workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's batches of (indices, images, tokens, labels): samples i with i % world == rank."""
    if s.val_data == SYNTHETIC:
        n = s.val_num_samples or DEFAULT_SYNTHETIC_VAL_SAMPLES
        ds = _SyntheticVal(s, list(range(rank, n, world)), preprocess, tokenizer, classnames)
        yield from torch.utils.data.DataLoader(ds, batch_size=s.batch_size, num_workers=workers)
        return
    batch: list = []
    for sample in _wds_samples(s, rank, world, preprocess, tokenizer, classnames):
        batch.append(sample)
        if len(batch) == s.batch_size:
            yield _collate(batch)
            batch = []
    if batch:
        yield _collate(batch)


def _collate(batch: list) -> tuple[torch.Tensor, ...]:
    idx, images, texts, labels = zip(*batch)
    return torch.tensor(idx), torch.stack(images), torch.stack(texts), torch.tensor(labels)


# --------------------------------------------------------------------------------------------- metrics


def retrieval_metrics(image: torch.Tensor, text: torch.Tensor) -> dict[str, float]:
    """Recall@1/5/10 and median rank both ways; pair i is (image[i], text[i]); features L2-normalised here."""
    image, text = F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1)
    out: dict[str, float] = {}
    for name, q, c in (("i2t", image, text), ("t2i", text, image)):
        ranks = _true_ranks(q, c)
        for k in RECALL_KS:
            out[f"{name}_R@{k}"] = float((ranks < k).float().mean())
        out[f"{name}_median_rank"] = float(statistics.median((ranks + 1).tolist()))
    return out


def _true_ranks(queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """0-based rank of candidate i for query i: candidates scoring higher, plus equal ones of lower index."""
    n = queries.shape[0]
    ranks = torch.empty(n, dtype=torch.long)
    idx = torch.arange(n)
    for start in range(0, n, _CHUNK):
        rows = slice(start, min(n, start + _CHUNK))
        sim = queries[rows] @ candidates.T
        true = sim[torch.arange(sim.shape[0]), idx[rows]].unsqueeze(1)
        before = idx.unsqueeze(0) < idx[rows].unsqueeze(1)
        ranks[rows] = ((sim > true) | ((sim == true) & before)).sum(1)
    return ranks


def contrastive_val_loss(
    image: torch.Tensor, text: torch.Tensor, logit_scale: float, logit_bias: float | None = None
) -> float:
    """The loss of all pairs as one batch: open_clip's ClipLoss (or SigLipLoss with logit_bias), chunked."""
    image, text = F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1)
    n = image.shape[0]
    total = 0.0
    for start in range(0, n, _CHUNK):
        rows = slice(start, min(n, start + _CHUNK))
        target = torch.arange(rows.start, rows.stop)
        li = logit_scale * image[rows] @ text.T
        if logit_bias is None:
            lt = logit_scale * text[rows] @ image.T
            total += (
                float(
                    F.cross_entropy(li, target, reduction="sum")
                    + F.cross_entropy(lt, target, reduction="sum")
                )
                / 2
            )
        else:
            labels = -torch.ones_like(li)
            labels[torch.arange(li.shape[0]), target] = 1
            total += float(-F.logsigmoid(labels * (li + logit_bias)).sum())
    return total / n


def zeroshot_accuracy(
    image: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor
) -> dict[str, float]:
    """Top-1 (and top-5 with >= 5 classes) accuracy of images with a label (>= 0) against [C, d] class embeddings."""
    keep = labels >= 0
    out: dict[str, float] = {"zeroshot_samples": float(keep.sum())}
    if not bool(keep.any()):
        return out
    logits = F.normalize(image[keep].float(), dim=-1) @ classifier.float().T
    y = labels[keep]
    out["zeroshot_top1"] = float((logits.argmax(1) == y).float().mean())
    if classifier.shape[0] >= 5:
        top5 = logits.topk(5, dim=1).indices
        out["zeroshot_top5"] = float((top5 == y.unsqueeze(1)).any(1).float().mean())
    return out


# ---------------------------------------------------------------------------------------- the runner


def _world() -> tuple[int, int]:
    from ds_clip import distributed

    return distributed.rank(), distributed.world_size()


@torch.no_grad()
def evaluate(
    forward: Forward,
    s: EvalSettings,
    *,
    preprocess,
    tokenizer,
    workers: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Every rank calls this (a collective); every rank returns the same metrics.

    ``forward(image=..., text=...)`` returns open_clip's output dict (either input may be None).
    """
    rank, world = _world()
    classnames, templates = load_zeroshot(s.zeroshot_classes) if s.zeroshot_classes else (None, None)
    batches = list(
        iter_val_batches(
            s,
            rank=rank,
            world=world,
            preprocess=preprocess,
            tokenizer=tokenizer,
            classnames=classnames,
            workers=workers,
        )
    )
    # ZeRO-3 gathers parameters inside forward: every rank must run the same number of forwards.
    n_forward = int(all_reduce_max(torch.tensor([len(batches)])))
    idx, imgs, txts, labels = [], [], [], []
    out: dict = {}
    for b in range(n_forward):
        pad = b >= len(batches)
        i, image, text, label = (
            batches[b] if not pad else (batches or [_padding(s, preprocess, tokenizer)])[-1]
        )
        out = forward(image=image.to(device), text=text.to(device))
        if pad:
            continue
        idx.append(i)
        # Features stay where the model put them (the GPU) until they are gathered.
        imgs.append(out["image_features"].float())
        txts.append(out["text_features"].float())
        labels.append(label)
    dim = out["image_features"].shape[-1]
    feat_device = out["image_features"].device
    cat = lambda xs, shape, dt, dev: torch.cat(xs) if xs else torch.zeros(shape, dtype=dt, device=dev)  # noqa: E731
    # Gathered on the device (NCCL has no CPU backend), then brought to the host for the metrics, whose
    # memory is O(chunk * N_val) on the CPU rather than on the accelerator.
    order_idx = all_gather_rows(cat(idx, (0,), torch.long, "cpu")).cpu()
    image_f = all_gather_rows(cat(imgs, (0, dim), torch.float32, feat_device)).cpu()
    text_f = all_gather_rows(cat(txts, (0, dim), torch.float32, feat_device)).cpu()
    label_all = all_gather_rows(cat(labels, (0,), torch.long, "cpu")).cpu()
    order = order_idx.argsort()
    image_f, text_f, label_all = image_f[order], text_f[order], label_all[order]
    if torch.unique(order_idx).numel() != order_idx.numel():
        raise RuntimeError("evaluation counted a sample twice: the per-rank slices overlap")
    scale = float(out["logit_scale"].float().reshape(-1)[0])
    bias = out.get("logit_bias")
    metrics: dict[str, float] = {"val_samples": float(image_f.shape[0])}
    metrics["val_loss"] = contrastive_val_loss(
        image_f, text_f, scale, None if bias is None else float(bias.float().reshape(-1)[0])
    )
    metrics.update(retrieval_metrics(image_f, text_f))
    if classnames:
        classifier = zeroshot_classifier(
            forward, tokenizer, classnames, templates, device=device, image=image
        )
        metrics.update(zeroshot_accuracy(image_f, label_all, classifier.cpu()))
    return metrics


def _padding(s: EvalSettings, preprocess, tokenizer):
    # A rank with no sample at all still runs forwards; any valid input does.
    from ds_clip.data.synthetic import render_pair

    image, caption = render_pair(0, 0, s.image_size)
    return (
        torch.tensor([0]),
        preprocess(image).unsqueeze(0),
        torch.as_tensor(tokenizer([caption])),
        torch.tensor([-1]),
    )


def zeroshot_classifier(
    forward: Forward,
    tokenizer,
    classnames: list[str],
    templates,
    *,
    device,
    image: torch.Tensor | None = None,
    classes_per_batch: int = 1,
    tokens: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """[C, d] class embeddings: mean of the normalised template embeddings, normalised (open_clip's recipe).

    Every rank computes all classes (same forward count on every rank), ``classes_per_batch`` classes' prompts
    per forward. One dummy image rides along with each text batch: the engine's top-level forward is the path
    ZeRO-3 gathers parameters on. ``tokens``: the prompts' token batches, already made (they depend on the
    tokenizer only, not on the weights).
    """
    rows = []
    img = image[:1].to(device) if image is not None else None
    for start in range(0, len(classnames), classes_per_batch):
        group = classnames[start : start + classes_per_batch]
        batch = (
            tokens[start // classes_per_batch]
            if tokens is not None
            else torch.as_tensor(tokenizer([t(c) for c in group for t in templates]))
        )
        feats = F.normalize(forward(image=img, text=batch.to(device))["text_features"].float(), dim=-1)
        emb = feats.view(len(group), len(templates), -1).mean(1)
        rows.append(F.normalize(emb, dim=-1))
    return torch.cat(rows)


# ------------------------------------------------------------------------------ ImageNet (open_clip's)

# --imagenet-val / --imagenet-v2 -> the metric names open_clip_train logs (imagenet-zeroshot-val-top1 ...).
IMAGENET_METRICS = {"--imagenet-val": "imagenet-zeroshot-val", "--imagenet-v2": "imagenetv2-zeroshot-val"}
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Classes whose 80 prompts share one text forward (open_clip's build_zero_shot_classifier batches 10).
_CLASSES_PER_BATCH = 10


@functools.lru_cache(maxsize=2)
def _imagenet_prompt_tokens(tokenizer) -> list[torch.Tensor]:
    """The 80,000 prompts of open_clip's ImageNet classifier, tokenized once per run (seconds of CPU each
    time otherwise), in batches of _CLASSES_PER_BATCH classes."""
    import open_clip

    names, templates = list(open_clip.IMAGENET_CLASSNAMES), list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    return [
        torch.as_tensor(tokenizer([t(c) for c in names[i : i + _CLASSES_PER_BATCH] for t in templates]))
        for i in range(0, len(names), _CLASSES_PER_BATCH)
    ]


class _ClassImages(torch.utils.data.Dataset):
    def __init__(self, samples: list[tuple[str, int]], preprocess) -> None:
        self.samples, self.preprocess = samples, preprocess

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as im:
            return self.preprocess(im.convert("RGB")), label


def imagenet_samples(folder: str, flag: str) -> list[tuple[str, int]]:
    """(image path, class index into open_clip's IMAGENET_CLASSNAMES) of every image, in a fixed order."""
    labels = imagenet_class_folders(folder, flag)
    root = Path(folder).expanduser()
    return [
        (str(p), labels[name])
        for name in sorted(labels)
        for p in sorted((root / name).iterdir())
        if p.suffix.lower() in _IMAGE_SUFFIXES
    ]


@torch.no_grad()
def imagenet_zeroshot(
    forward: Forward,
    folders: dict[str, str],
    *,
    preprocess,
    tokenizer,
    batch_size: int,
    device,
    workers: int = 0,
) -> dict[str, float]:
    """open_clip_train's ImageNet zero-shot: the classifier from open_clip's 1000 IMAGENET_CLASSNAMES and its
    OPENAI_IMAGENET_TEMPLATES, top-1/top-5 of every image of each folder (``{flag: DIR}``). Every rank
    classifies images i with i % world == rank and the counts are summed; every rank calls this (a collective)
    and returns the same metrics."""
    import open_clip
    from PIL import Image

    rank, world = _world()
    dummy = preprocess(Image.new("RGB", (32, 32))).unsqueeze(0).to(device)
    classifier = zeroshot_classifier(
        forward, tokenizer, list(open_clip.IMAGENET_CLASSNAMES), list(open_clip.OPENAI_IMAGENET_TEMPLATES),
        device=device, image=dummy, classes_per_batch=_CLASSES_PER_BATCH, tokens=_imagenet_prompt_tokens(tokenizer),
    )  # fmt: skip
    dummy_text = torch.as_tensor(tokenizer(["a photo"])).to(device)
    out: dict[str, float] = {}
    for flag, folder in folders.items():
        samples = imagenet_samples(folder, flag)
        mine = samples[rank::world]
        loader = torch.utils.data.DataLoader(
            _ClassImages(mine, preprocess), batch_size=batch_size, num_workers=workers
        )
        # ZeRO-3 gathers parameters inside forward: every rank runs the largest rank's number of forwards.
        n_forward = -(-len(samples[0::world]) // batch_size)
        counts = torch.zeros(3, dtype=torch.float64)  # top-1 hits, top-5 hits, images
        batches = iter(loader)
        for _ in range(n_forward):
            batch = next(batches, None)
            image = batch[0] if batch is not None else dummy
            feats = forward(image=image.to(device), text=dummy_text)["image_features"].float()
            if batch is None:
                continue
            logits = F.normalize(feats, dim=-1) @ classifier.T
            y = batch[1].to(logits.device)
            top5 = logits.topk(5, dim=1).indices
            counts += torch.tensor(
                [float((top5[:, 0] == y).sum()), float((top5 == y.unsqueeze(1)).any(1).sum()), float(len(y))],
                dtype=torch.float64,
            )
        total = all_reduce_sum(to_device(counts)).cpu()
        name = IMAGENET_METRICS[flag]
        out[f"{name}-top1"] = float(total[0] / max(total[2], 1))
        out[f"{name}-top5"] = float(total[1] / max(total[2], 1))
        out[f"{name}-samples"] = float(total[2])
    return out


def engine_forward(engine) -> Forward:
    """The engine's top-level forward with inputs cast to its dtype (bf16/fp16 engines)."""
    from ds_clip.step import input_dtype

    dtype = input_dtype(engine)

    def forward(image=None, text=None):
        return engine(image=None if image is None else image.to(dtype), text=text)

    return forward


def run_on_engine(engine, s: EvalSettings, *, preprocess, tokenizer, workers: int = 0) -> dict[str, float]:
    """Evaluate the engine's model (every rank calls this); restores train mode."""
    was_training = engine.module.training
    engine.eval()
    try:
        return evaluate(
            engine_forward(engine),
            s,
            preprocess=preprocess,
            tokenizer=tokenizer,
            workers=workers,
            device=engine.device,
        )
    finally:
        if was_training:
            engine.train()


# ------------------------------------------------------------------------------------------- reporting


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
    for name in IMAGENET_METRICS.values():
        if f"{name}-top1" in m:
            parts.append(f"{name} top1/top5 {m[f'{name}-top1']:.3f}/{m[f'{name}-top5']:.3f}")
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
    json_path = run_dir / "eval_results.json"
    history = json.loads(json_path.read_text()) if json_path.exists() else []
    history = [h for h in history if h.get("step") != step] + [row]
    tmp = json_path.with_name(".eval_results.json.tmp")
    tmp.write_text(json.dumps(history, indent=1))
    os.replace(tmp, json_path)


# ------------------------------------------------------------------------------------------- ds-clip-eval


# The flags ds-clip-eval shares with ds-clip-train, each defined once (ds_clip.config's fields).
SHARED_FLAGS = ("pretrained", "cache_dir", "val_data", "val_num_samples", "batch_size", "zeroshot_classes", "seed",
                "image_key", "caption_key")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-clip-eval",
        description="Evaluate an exported (or any open_clip) model: val loss, retrieval recall, zero-shot accuracy.",
    )
    p.add_argument(
        "model",
        help="exported folder (ds-clip-export OUT), local-dir:PATH, hf-hub:ORG/REPO, or an open_clip model name "
        "(with --pretrained TAG|FILE)",
    )
    add_flags(p, SHARED_FLAGS, val_data={"required": True}, batch_size={"default": EVAL_BATCH_SIZE})
    p.add_argument("--out", metavar="JSON", default=None, help="also write the metrics to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            section = EvalSectionSettings(
                val_data=args.val_data,
                val_num_samples=args.val_num_samples,
                zeroshot_classes=args.zeroshot_classes,
            )
            check_eval(section, batch_size=args.batch_size)
            check_data(DataSettings(seed=args.seed, image_key=args.image_key, caption_key=args.caption_key))
        except SettingsError as exc:
            raise EvalError(str(exc)) from exc
        if args.zeroshot_classes:
            load_zeroshot(args.zeroshot_classes)
        name = args.model
        if Path(name).is_dir() and (Path(name) / "open_clip_config.json").is_file():
            name = f"local-dir:{name}"
        from ds_clip.config.model_checks import check_pretrained
        from ds_clip.export import resolve_pretrained
        from ds_clip.model import build_model, load_model_cfg

        if args.pretrained:
            try:
                check_pretrained(args.pretrained, model=name)
            except SettingsError as exc:
                raise EvalError(str(exc)) from exc
        try:  # published weights: fetched into --cache-dir unless cached; offline, refused when not cached
            bundle = build_model(
                name, pretrained=resolve_pretrained(args.pretrained), seed=None, cache_dir=args.cache_dir
            )
        except (RuntimeError, ValueError, FileNotFoundError) as exc:
            raise EvalError(f"cannot load model {args.model!r}: {exc}") from exc
    except (EvalError, UserError) as exc:
        print(f"ds-clip-eval: error: {exc}", file=sys.stderr)
        return 2
    model = bundle.model.eval()
    size = load_model_cfg(name, args.cache_dir)["vision_cfg"].get("image_size", 224)
    s = EvalSettings(
        **{name: getattr(args, name) for name in SHARED_FLAGS if name not in ("pretrained", "cache_dir")},
        image_size=size if isinstance(size, int) else size[0],
    )
    metrics = evaluate(
        lambda image=None, text=None: model(image=image, text=text),
        s,
        preprocess=bundle.preprocess_val,
        tokenizer=bundle.tokenizer,
    )
    text = json.dumps(metrics, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "EvalError",
    "EvalSettings",
    "contrastive_val_loss",
    "evaluate",
    "label_from_caption",
    "load_zeroshot",
    "main",
    "report",
    "retrieval_metrics",
    "run_on_engine",
    "zeroshot_accuracy",
    "zeroshot_classifier",
]


# ----------------------------------------------------------------------------------------- the cadence


class Evaluator:
    """When the trainer evaluates, and what: owns ``--val-every-n-steps`` and ``--val-frequency`` (epochs) for
    the --val-data evaluation, ``--zeroshot-frequency`` (epochs) for the zero-shot ones (--imagenet-val,
    --imagenet-v2, and --zeroshot-classes, which is computed with --val-data: its cadence runs that too), and
    the final evaluation of everything. Every rank holds one and calls every method (each rank embeds its
    slice: a collective); rank 0 reports all metrics of a step in one row."""

    def __init__(
        self,
        engine,
        settings: EvalSettings | None,
        *,
        preprocess,
        tokenizer,
        run_dir: Path,
        every_n_steps: int | None,
        is_main: bool,
        val_every_n_epochs: int | None = None,
        zeroshot_every_n_epochs: int | None = None,
        steps_per_epoch: int | None = None,
        imagenet: dict[str, str] | None = None,
        batch_size: int = EVAL_BATCH_SIZE,
        views: dict[str, Callable[[], AbstractContextManager]] | None = None,
    ) -> None:
        """``views``: other weights evaluated beside the live ones, metrics prefixed by the key (``"ema/"``);
        the value makes the engine compute with those weights inside its block (every rank enters it)."""
        self.views = views or {}
        self.engine, self.settings = engine, settings
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.run_dir, self.every_n_steps, self.is_main = Path(run_dir), every_n_steps, is_main
        self.val_every_n_epochs, self.zeroshot_every_n_epochs = val_every_n_epochs, zeroshot_every_n_epochs
        self.steps_per_epoch, self.imagenet, self.batch_size = steps_per_epoch, imagenet or {}, batch_size

    def run(self, step: int, tb_writer=None, *, val: bool = True, zeroshot: bool = True) -> None:
        metrics = self._metrics(val=val, zeroshot=zeroshot)
        for prefix, weights in self.views.items():
            if metrics:
                with weights():
                    metrics.update(
                        {prefix + k: v for k, v in self._metrics(val=val, zeroshot=zeroshot).items()}
                    )
        if metrics and self.is_main:
            report(self.run_dir, step, metrics, tb_writer)

    def _metrics(self, *, val: bool, zeroshot: bool) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.settings is not None and (val or (zeroshot and self.settings.zeroshot_classes)):
            metrics.update(
                run_on_engine(
                    self.engine, self.settings, preprocess=self.preprocess, tokenizer=self.tokenizer
                )
            )
        if self.imagenet and zeroshot:
            was_training = self.engine.module.training
            self.engine.eval()
            try:
                metrics.update(
                    imagenet_zeroshot(
                        engine_forward(self.engine), self.imagenet, preprocess=self.preprocess,
                        tokenizer=self.tokenizer, batch_size=self.batch_size, device=self.engine.device,
                    )
                )  # fmt: skip
            finally:
                if was_training:
                    self.engine.train()
        return metrics

    def maybe_run(self, step: int, total_steps: int, tb_writer=None) -> None:
        """Evaluate what is on its cadence; the last step is evaluated by ``run`` at the end of the run, once."""
        if step >= total_steps:
            return
        epochs = epochs_done_at(step, self.steps_per_epoch)
        val = on_cadence(step, self.every_n_steps, epochs, self.val_every_n_epochs)
        zeroshot = on_cadence(step, None, epochs, self.zeroshot_every_n_epochs)
        if val or zeroshot:
            self.run(step, tb_writer, val=val, zeroshot=zeroshot)
