"""One evaluation of --val-data (a collective: every rank embeds its slice, features are gathered, every rank
returns the same metrics), on any forward or on the DeepSpeed engine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_clip import distributed
from ds_clip.distributed import all_gather_rows, all_reduce_max
from ds_clip.evaluate.agreement import agree, describe
from ds_clip.evaluate.classes import load_zeroshot
from ds_clip.evaluate.datasets import _padding, iter_val_batches
from ds_clip.evaluate.metrics import contrastive_val_loss, retrieval_metrics, zeroshot_accuracy
from ds_clip.evaluate.settings import EvalFailed, EvalSettings, Forward
from ds_clip.evaluate.zeroshot import zeroshot_classifier


@torch.no_grad()
def _gather_in_order(
    idx: list, imgs: list, txts: list, labels: list, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's features and labels, in sample order (a collective). ``like``: a feature tensor of this
    rank's forward (its width and device)."""
    dim, feat_device = like.shape[-1], like.device
    cat = lambda xs, shape, dt, dev: torch.cat(xs) if xs else torch.zeros(shape, dtype=dt, device=dev)  # noqa: E731
    # Gathered on the device (NCCL has no CPU backend), then brought to the host for the metrics, whose
    # memory is O(chunk * N_val) on the CPU rather than on the accelerator.
    order_idx = all_gather_rows(cat(idx, (0,), torch.long, "cpu")).cpu()
    image_f = all_gather_rows(cat(imgs, (0, dim), torch.float32, feat_device)).cpu()
    text_f = all_gather_rows(cat(txts, (0, dim), torch.float32, feat_device)).cpu()
    label_all = all_gather_rows(cat(labels, (0,), torch.long, "cpu")).cpu()
    if torch.unique(order_idx).numel() != order_idx.numel():
        raise RuntimeError("evaluation counted a sample twice: the per-rank slices overlap")
    order = order_idx.argsort()
    return image_f[order], text_f[order], label_all[order]


@torch.no_grad()  # no autograd graph (and no "requires_grad=True to a scalar" warning on the logit scale)
def evaluate(
    forward: Forward,
    s: EvalSettings,
    *,
    preprocess,
    tokenizer,
    workers: int = 0,
    device: torch.device | str = "cpu",
    before_read: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Every rank calls this (a collective); every rank returns the same metrics, or raises ``EvalFailed``
    (every rank together) when some rank could not read its samples or run its forwards.

    ``forward(image=..., text=...)`` returns open_clip's output dict (either input may be None).
    ``before_read``: called where this rank reads its samples (fault injection; None in a normal run).
    """
    rank, world = distributed.rank(), distributed.world_size()
    # This rank's classes and samples, all read before the first collective: a read that fails (a shard gone,
    # a network store down) is agreed on below instead of raised here.
    error = None
    classnames, templates = None, None
    try:
        if s.zeroshot_classes:
            classnames, templates = load_zeroshot(s.zeroshot_classes)
        if before_read is not None:
            before_read()
        batches = list(
            iter_val_batches(
                s, rank=rank, world=world, preprocess=preprocess, tokenizer=tokenizer, classnames=classnames,
                workers=workers,
            )
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any read failure of one rank is agreed on, then reported
        batches, error = [], f"--val-data {s.val_data}: {describe(exc)}"
    # ZeRO-3 gathers parameters inside forward: every rank must run the same number of forwards.
    n_forward, failed = all_reduce_max(torch.tensor([len(batches), error is not None])).tolist()
    if failed:
        agree(error)
    if n_forward == 0:  # the same on every rank
        raise EvalFailed(
            f"--val-data {s.val_data}: no sample could be read on any rank (see the skipped-sample warnings)"
        )
    idx, imgs, txts, labels = [], [], [], []
    out: dict = {}
    for b in range(int(n_forward)):
        pad = b >= len(batches) or error is not None
        if not pad:
            i, image, text, label = batches[b]
        elif batches and error is None:
            i, image, text, label = batches[-1]
        else:  # no batch here, or this rank's forward failed: any valid input keeps the forward count
            i, image, text, label = _padding(s, preprocess, tokenizer)
        try:
            out = forward(image=image.to(device), text=text.to(device))
        except Exception as exc:  # noqa: BLE001 - agreed on after the loop; the padding forwards go on
            error = error or f"evaluation forward: {describe(exc)}"
            continue
        if pad:
            continue
        idx.append(i)
        # Features stay where the model put them (the GPU) until they are gathered.
        imgs.append(out["image_features"].float())
        txts.append(out["text_features"].float())
        labels.append(label)
    agree(error)
    image_f, text_f, label_all = _gather_in_order(idx, imgs, txts, labels, out["image_features"])
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


def engine_forward(engine) -> Forward:
    """The engine's top-level forward with inputs cast to its dtype (bf16/fp16 engines)."""
    from ds_clip.step.cached import input_dtype

    dtype = input_dtype(engine)

    def forward(image=None, text=None):
        return engine(image=None if image is None else image.to(dtype), text=text)

    return forward


def run_on_engine(
    engine,
    s: EvalSettings,
    *,
    preprocess,
    tokenizer,
    workers: int = 0,
    before_read: Callable[[], None] | None = None,
) -> dict[str, float]:
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
            before_read=before_read,
        )
    finally:
        if was_training:
            engine.train()
