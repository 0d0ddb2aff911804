"""The one-process oracle: the full-batch gradient ds_clip promises, computed the plain way (one process,
the whole N = W·k·m batch, open_clip's own losses), and the per-parameter error of a run against it."""

from __future__ import annotations

import torch

from ds_clip.step.cached import micro_batch_seed
from ds_clip_harness.runs import RunResult, RunSpec, step_micro_batches


def oracle_first_step(spec: RunSpec, world_size: int) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients of step 0 in ONE process holding the whole N = W·k·m batch, with open_clip's own loss.

    Each global micro-batch g is embedded with its seed (so dropout draws what the distributed run
    draws), the embeddings are concatenated, and open_clip's ``ClipLoss()`` / ``SigLipLoss()`` (world
    size 1) is backpropagated: the definition of the full-batch gradient ds_clip promises. A CoCa model:
    open_clip's ``CoCaLoss`` (the flags' default weights) on the whole batch, whose caption mean is then over
    the non-pad tokens of all N captions. With ``spec.distill_model``: open_clip's ``DistillClipLoss()``
    (contrastive + distill, summed as open_clip_train sums them) against the teacher's embeddings of the whole
    batch, the teacher as open_clip_train runs it (its own weights, eval mode, no grad).
    """
    from open_clip.loss import ClipLoss, CoCaLoss, DistillClipLoss, SigLipLoss

    from ds_clip.models.model import TowerLocks, build_model
    from ds_clip.step.caption import is_captioning

    bundle = build_model(
        spec.model,
        seed=spec.seed,
        grad_checkpointing=spec.grad_checkpointing,
        locks=TowerLocks(image=spec.lock_image, text=spec.lock_text, text_freeze_layer_norm=spec.lock_text),
    )
    model = bundle.model.train()
    images, texts, logits, labels, out, all_batches = [], [], [], [], None, []
    for r in range(world_size):
        batches, gids = step_micro_batches(spec, bundle.model_cfg, 0, r, world_size)
        all_batches += batches
        for (img, txt), g in zip(batches, gids):
            torch.manual_seed(micro_batch_seed(spec.seed, 0, g))
            out = model(image=img, text=txt)
            images.append(out["image_features"])
            texts.append(out["text_features"])
            if is_captioning(model):
                logits.append(out["logits"])
                labels.append(out["labels"])
    image, text = torch.cat(images), torch.cat(texts)
    if is_captioning(model):
        from ds_clip.config import LossSettings

        weights = LossSettings()
        coca = CoCaLoss(
            caption_loss_weight=weights.coca_caption_loss_weight,
            clip_loss_weight=weights.coca_contrastive_loss_weight,
            pad_id=model.pad_id,
        )
        contrastive, caption = coca(image, text, torch.cat(logits), torch.cat(labels), out["logit_scale"])
        loss = contrastive + caption
    elif spec.distill_model:
        teacher = build_model(spec.distill_model, seed=None).model.eval()
        with torch.no_grad():
            t = teacher(
                image=torch.cat([i for i, _ in all_batches]), text=torch.cat([x for _, x in all_batches])
            )
        contrastive, distill = DistillClipLoss()(
            image, text, out["logit_scale"], t["image_features"], t["text_features"], t["logit_scale"]
        )
        loss = contrastive + distill
    elif spec.loss.siglip:
        loss = SigLipLoss()(image, text, out["logit_scale"], out["logit_bias"])
    else:
        loss = ClipLoss()(image, text, out["logit_scale"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


def oracle_errors(result: RunResult, oracle_grads: dict[str, torch.Tensor], floor: float) -> dict[str, float]:
    """Per-parameter error ||g - g_oracle|| / max(||g_oracle||, floor * ||total oracle gradient||).

    The floor matters only for parameters whose true gradient nearly cancels (attention key biases
    get exactly 0, attention-pool q/k projections ~1e-6 of the total at init): there the bare
    relative error measures float noise, not the step. Every other parameter is held to its own norm.
    """
    total = float(torch.sqrt(sum(g.pow(2).sum() for g in oracle_grads.values())))
    return {
        name: float((result.grads[name].reshape(g.shape) - g).norm()) / max(float(g.norm()), floor * total)
        for name, g in oracle_grads.items()
    }
