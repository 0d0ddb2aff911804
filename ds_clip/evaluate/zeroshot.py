"""Zero-shot classifiers (open_clip's recipe: the mean of normalised template embeddings) and open_clip_train's
ImageNet zero-shot over class folders."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds_clip import distributed
from ds_clip.distributed import all_reduce_sum, to_device
from ds_clip.evaluate.agreement import agree, describe
from ds_clip.evaluate.classes import folder_classes, load_templates
from ds_clip.evaluate.datasets import (
    _ClassImages,
    class_folder_samples,
    collate_class_images,
    imagenet_samples,
)
from ds_clip.evaluate.metrics import FOLDER_METRIC, IMAGENET_METRICS
from ds_clip.evaluate.settings import Forward
from ds_clip.stop_signals import loader_workers

logger = logging.getLogger("ds_clip")

# Classes whose 80 prompts share one text forward (open_clip's build_zero_shot_classifier batches 10).
_CLASSES_PER_BATCH = 10


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


@dataclass(frozen=True)
class ClassFolderTask:
    """One class-folder tree to classify: its images and labels, the classes and their prompt templates, and
    the prefix of its metrics (``<metric>-top1``, ``-top5``, ``-samples``)."""

    flag: str
    """The flag that named the folder (--imagenet-val, --zeroshot-folder), for messages."""
    folder: str
    metric: str
    classnames: tuple[str, ...]
    templates: tuple[Callable[[str], str], ...]
    list_samples: Callable[[], list[tuple[str, int]]]
    """(image path, label) of every image, in a fixed order: listed at each evaluation (a folder may change)."""
    tokens: Callable[[], list[torch.Tensor]] | None = None
    """The prompts' token batches of _CLASSES_PER_BATCH classes, made once (ImageNet's 80,000 prompts)."""


def imagenet_tasks(folders: dict[str, str], tokenizer) -> list[ClassFolderTask]:
    """open_clip_train's ImageNet zero-shot (``{flag: DIR}``): open_clip's 1000 IMAGENET_CLASSNAMES and its
    OPENAI_IMAGENET_TEMPLATES."""
    import open_clip

    return [
        ClassFolderTask(
            flag,
            folder,
            IMAGENET_METRICS[flag],
            tuple(open_clip.IMAGENET_CLASSNAMES),
            tuple(open_clip.OPENAI_IMAGENET_TEMPLATES),
            functools.partial(imagenet_samples, folder, flag),
            functools.partial(_imagenet_prompt_tokens, tokenizer),
        )  # fmt: skip
        for flag, folder in folders.items()
    ]


def folder_task(folder: str, classnames: str | None, templates: str) -> ClassFolderTask:
    """--zeroshot-folder DIR (--zeroshot-classnames, --zeroshot-templates): zero-shot on your own classes."""
    folders, names = folder_classes(folder, classnames)
    labels = {f: i for i, f in enumerate(folders)}
    return ClassFolderTask(
        "--zeroshot-folder", folder, FOLDER_METRIC, tuple(names), tuple(load_templates(templates)),
        functools.partial(class_folder_samples, folder, labels),
    )  # fmt: skip


@torch.no_grad()
def classify_folders(
    forward: Forward,
    tasks: list[ClassFolderTask],
    *,
    preprocess,
    tokenizer,
    batch_size: int,
    device,
    workers: int = 0,
) -> dict[str, float]:
    """Zero-shot top-1/top-5 of every image of each task's folder against its classes' classifier
    (open_clip's recipe). Every rank classifies images i with i % world == rank and the counts are summed;
    every rank calls this (a collective) and returns the same metrics, or raises ``EvalFailed`` together
    when a rank could not list or read its images."""
    from PIL import Image

    rank, world = distributed.rank(), distributed.world_size()
    dummy = preprocess(Image.new("RGB", (32, 32))).unsqueeze(0).to(device)
    dummy_text = torch.as_tensor(tokenizer(["a photo"])).to(device)
    classifiers: dict[tuple, torch.Tensor] = {}
    out: dict[str, float] = {}
    for task in tasks:
        key = (task.classnames, task.templates)
        if key not in classifiers:  # --imagenet-val and --imagenet-v2 share one
            classifiers[key] = zeroshot_classifier(
                forward, tokenizer, list(task.classnames), list(task.templates), device=device, image=dummy,
                classes_per_batch=_CLASSES_PER_BATCH, tokens=task.tokens() if task.tokens else None,
            )  # fmt: skip
        out.update(
            _classify(forward, task, classifiers[key], preprocess, batch_size, device, workers, dummy, dummy_text,
                      rank, world)
        )  # fmt: skip
    return out


def _classify(
    forward, task, classifier, preprocess, batch_size, device, workers, dummy, dummy_text, rank, world
) -> dict[str, float]:
    """One task's counts on this rank, summed over ranks; the listing and the reading are agreed on (``agree``)
    so that a rank that fails does not leave the others in a collective."""
    error = None
    try:
        samples = task.list_samples()
    except Exception as exc:  # noqa: BLE001 - agreed on below, before the first forward
        samples, error = [], f"{task.flag} {task.folder}: {describe(exc)}"
    agree(error)  # every rank listed the same images (or all raise together)
    loader = torch.utils.data.DataLoader(
        _ClassImages(samples[rank::world], preprocess),
        batch_size=batch_size,
        collate_fn=collate_class_images,
        **loader_workers(workers),  # forkserver; a stop signal is the rank's to handle (stop_signals)
    )
    # ZeRO-3 gathers parameters inside forward: every rank runs the largest rank's number of forwards.
    n_forward = -(-len(samples[0::world]) // batch_size)
    k = min(5, len(task.classnames))
    counts = torch.zeros(4, dtype=torch.float64)  # top-1 hits, top-k hits, images, images skipped
    first_skip = ""
    batches = iter(loader)
    for _ in range(n_forward):
        batch = None
        if error is None:
            try:
                batch = next(batches, None)
            except Exception as exc:  # noqa: BLE001 - a listing or loader failure: agreed on after the loop
                error = f"{task.flag} {task.folder}: {describe(exc)}"
        if (
            batch is not None
        ):  # an image that cannot be read is skipped and counted, as a bad --val-data sample
            counts[3] += len(batch[2])
            first_skip = first_skip or (batch[2][0] if batch[2] else "")
            batch = batch if batch[0] is not None else None
        image = batch[0] if batch is not None else dummy
        try:
            feats = forward(image=image.to(device), text=dummy_text)["image_features"].float()
        except Exception as exc:  # noqa: BLE001 - agreed on after the loop; the padding forwards go on
            error = error or f"{task.flag} zero-shot forward: {describe(exc)}"
            continue
        if batch is None:
            continue
        logits = F.normalize(feats, dim=-1) @ classifier.T
        y = batch[1].to(logits.device)
        topk = logits.topk(k, dim=1).indices
        counts += torch.tensor(
            [
                float((topk[:, 0] == y).sum()),
                float((topk == y.unsqueeze(1)).any(1).sum()),
                float(len(y)),
                0.0,
            ],
            dtype=torch.float64,
        )
    agree(error)
    total = all_reduce_sum(to_device(counts)).cpu()
    if total[3] and rank == 0:  # the count of every rank, in one line (with rank 0's first one, if any)
        logger.warning(
            "%s %s: skipped %d image(s) that cannot be read; the %d others are classified%s", task.flag,
            task.folder, int(total[3]), int(total[2]), f" (first: {first_skip})" if first_skip else "",
        )  # fmt: skip
    out = {f"{task.metric}-top1": float(total[0] / max(total[2], 1))}
    if k == 5:  # with fewer classes every image is in the top 5
        out[f"{task.metric}-top5"] = float(total[1] / max(total[2], 1))
    out[f"{task.metric}-samples"] = float(total[2])
    return out


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
    OPENAI_IMAGENET_TEMPLATES, top-1/top-5 of every image of each folder (``{flag: DIR}``); a collective."""
    return classify_folders(
        forward, imagenet_tasks(folders, tokenizer), preprocess=preprocess, tokenizer=tokenizer,
        batch_size=batch_size, device=device, workers=workers,
    )  # fmt: skip
