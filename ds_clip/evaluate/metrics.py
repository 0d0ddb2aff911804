"""The metrics, on gathered features (pure functions, no I/O, no collectives): retrieval recall and median
rank, the contrastive loss of all pairs as one batch, zero-shot accuracy."""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

RECALL_KS = (1, 5, 10)
_CHUNK = 1024  # rows of the similarity matrix held at once: memory O(chunk * N_val)
# --imagenet-val / --imagenet-v2 -> the metric names open_clip_train logs (imagenet-zeroshot-val-top1 ...).
IMAGENET_METRICS = {"--imagenet-val": "imagenet-zeroshot-val", "--imagenet-v2": "imagenetv2-zeroshot-val"}
# --zeroshot-folder -> zeroshot-folder-top1, -top5, -samples (the same metrics as ImageNet's).
FOLDER_METRIC = "zeroshot-folder"


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
