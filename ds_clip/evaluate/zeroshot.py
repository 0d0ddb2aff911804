"""Zero-shot classifiers (open_clip's recipe: the mean of normalised template embeddings) and open_clip_train's
ImageNet zero-shot over class folders."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ds_clip import distributed
from ds_clip.distributed import all_reduce_sum, to_device
from ds_clip.evaluate.datasets import _ClassImages, imagenet_samples
from ds_clip.evaluate.metrics import IMAGENET_METRICS
from ds_clip.evaluate.settings import Forward

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

    rank, world = distributed.rank(), distributed.world_size()
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
