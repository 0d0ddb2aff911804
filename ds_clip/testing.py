"""Train the same steps under different (W ranks, k micro-batches) splits: the harness the equivalence tests,
the equivalence report, the GPU check and the benchmark share (public so that scripts need not import
``tests``). Every run builds its engine with ``ds_clip.engine`` from ``ds-clip-train`` flags, so what is
proven is what the trainer builds from the shipped presets: DeepSpeed's config-built AdamW (CPU Adam
under offload), the LR schedule, the resolved JSON.

Generated data is assigned by *global sample index*: optimizer step s trains samples
``s·N + [0, N)`` with N = W·k·m, and global micro-batch g (rank r, micro-batch j, g = r·k + j) holds
samples ``s·N + g·m + [0, m)``. Stochastic layers are seeded from (seed, s, g). So any split with
the same W·k·m trains the same pairs with the same dropout masks in every step, and the cached
step must make them agree to float rounding.

``run_in_group`` runs inside an initialised process group (every rank calls it); ``spawn_group``
starts W local processes over gloo and runs many specs in one process group, because a DeepSpeed
start costs seconds to minutes on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_clip import distributed
from ds_clip.loss import LossSpec
from ds_clip.step import micro_batch_seed


@dataclass
class RunSpec:
    """One training run of a few steps on generated data."""

    model: str
    """open_clip model name or local-dir:PATH."""
    micro_batch_size: int
    accum_freq: int
    steps: int
    zero_stage: int = 0
    precision: str = "fp32"
    offload: bool = False
    """Optimizer state (and with ZeRO-3 parameters) offloaded to the CPU."""
    loss: LossSpec = field(default_factory=LossSpec)
    grad_checkpointing: bool = False
    lr: float = 1e-3
    eps: float = 1e-8
    seed: int = 0
    capture_grads: bool = False
    """Record the full-batch gradient of every parameter at the first step (as DeepSpeed holds it)."""
    nan_at: tuple[int, int] | None = None
    """(step, rank): feed NaN images to that rank's first micro-batch at that step (fault tests)."""
    count_collectives: bool = False
    """Count DeepSpeed collectives per step with DeepSpeed's comms logger."""
    coalesce: str = "off"
    """--coalesce-grad-reduction: "on" reduces gradients once per step on ZeRO 1-3."""
    lock_image: bool = False
    """--lock-image (LiT): the image tower frozen, as open_clip locks it."""
    lock_text: bool = False
    """--lock-text --lock-text-freeze-layer-norm: the text tower frozen."""
    torchcompile: bool = False
    """--torchcompile: the model compiled (DeepSpeed's engine.compile, inductor)."""
    varied_captions: bool = False
    """Captions of different lengths (2 .. context_length - 1 tokens before the end token), for the CoCa
    caption term, whose normaliser is the token count."""
    distill_model: str | None = None
    """--distill-model: a frozen teacher (local-dir: with weights); the loss is open_clip's DistillClipLoss."""
    name: str = ""


@dataclass
class RunResult:
    spec: RunSpec
    world_size: int
    losses: list[float]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor] | None = None
    collectives: dict[str, dict[int, int]] | None = None
    """DeepSpeed collective calls in the last optimizer step: op name -> message bytes -> calls."""
    num_params: int = 0
    skipped: list[bool] = field(default_factory=list)
    """Per step: was the update skipped for a non-finite value."""

    def gradient_reduction_passes(self) -> float:
        """Gradient bytes reduced in one step / the model's gradient bytes (fp32 models).

        Counting bytes rather than calls makes the figure independent of DeepSpeed's bucketing;
        small messages (loss-scale and norm checks) are left out.
        """
        reduced = sum(
            size * calls
            for op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce")
            for size, calls in (self.collectives or {}).get(op, {}).items()
            if size > 1024
        )
        return reduced / (4 * self.num_params)


def generated_pairs(
    indices: Sequence[int],
    *,
    image_size: int,
    context_length: int,
    vocab_size: int,
    seed: int = 0,
    varied_lengths: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image-text pairs defined by global sample index alone (16 latent classes, so the loss can fall).
    ``varied_lengths``: caption lengths differ by sample (else all are context_length // 2)."""
    images, texts = [], []
    for idx in indices:
        g = torch.Generator().manual_seed(seed * 7_919 + int(idx))
        cls = int(idx) % 16
        proto = torch.Generator().manual_seed(seed * 104_729 + cls)
        image = torch.randn(3, image_size, image_size, generator=proto) + 0.5 * torch.randn(
            3, image_size, image_size, generator=g
        )
        length = max(2, context_length // 2)
        if varied_lengths:
            length = 2 + (int(idx) * 3) % (context_length - 2)  # 2 .. context_length - 1, then the end token
        tokens = torch.randint(1, vocab_size - 1, (length,), generator=proto)
        noise = torch.rand(length, generator=g) < 0.2
        tokens[noise] = torch.randint(1, vocab_size - 1, (int(noise.sum()),), generator=g)
        text = torch.zeros(context_length, dtype=torch.long)
        text[:length] = tokens
        text[length] = vocab_size - 1  # an "end" token with the largest id: open_clip pools at argmax
        images.append(image)
        texts.append(text)
    return torch.stack(images), torch.stack(texts)


def step_micro_batches(
    spec: RunSpec, model_cfg: dict, step: int, rank: int, world_size: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """This rank's k micro-batches of step ``step`` and their global micro-batch indices."""
    m, k = spec.micro_batch_size, spec.accum_freq
    n = world_size * k * m
    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    size = vision["image_size"] if isinstance(vision["image_size"], int) else vision["image_size"][0]
    batches, ids = [], []
    for j in range(k):
        g = rank * k + j
        start = step * n + g * m
        batches.append(
            generated_pairs(
                range(start, start + m),
                image_size=size,
                context_length=text.get("context_length", 77),
                vocab_size=text.get("vocab_size", 49408),
                seed=spec.seed,
                varied_lengths=spec.varied_captions,
            )
        )
        ids.append(g)
    return batches, ids


# A schedule this long is flat over a few test steps (cosine(3e-6 pi) = 1 - 4e-11): the runs compare
# arithmetic, not schedules, and both splits see the same LR anyway.
FLAT_SCHEDULE_STEPS = 10**6


def train_argv(spec: RunSpec, preset_dir: str | None = None) -> list[str]:
    """The ``ds-clip-train`` flags that build the engine of ``spec`` (the shipped presets; a temporary
    preset with DeepSpeed's comms logger on when ``count_collectives``)."""
    if spec.offload:
        preset = f"zero{max(spec.zero_stage, 2)}_offload_{spec.precision}"
    else:
        preset = f"zero{spec.zero_stage}_{spec.precision}"
    if spec.count_collectives:
        assert preset_dir is not None
        from ds_clip.ds_config import load_preset

        cfg = load_preset(preset)
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
        path = os.path.join(preset_dir, f"{preset}_comms.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        preset = path
    argv = [
        "--model", spec.model, "--batch-size", str(spec.micro_batch_size), "--accum-freq", str(spec.accum_freq),
        "--ds-config", preset, "--zero-stage", str(spec.zero_stage), "--precision", spec.precision,
        "--lr", repr(spec.lr), "--eps", repr(spec.eps), "--beta1", "0.9", "--beta2", "0.98", "--wd", "0",
        "--warmup", "0", "--seed", str(spec.seed), "--workers", "0", "--loss-impl", spec.loss.impl,
        "--loss-tile-size", str(spec.loss.tile_size),
        "--coalesce-grad-reduction", spec.coalesce,
    ]  # fmt: skip
    if spec.loss.siglip:
        argv.append("--siglip")
    if spec.loss.local_loss:
        argv.append("--local-loss")
    if spec.loss.gather_with_grad:
        argv.append("--gather-with-grad")
    if spec.grad_checkpointing:
        argv.append("--grad-checkpointing")
    if spec.lock_image:
        argv.append("--lock-image")
    if spec.lock_text:
        argv += ["--lock-text", "--lock-text-freeze-layer-norm"]
    if spec.torchcompile:
        argv.append("--torchcompile")
    if spec.distill_model:
        argv += ["--distill-model", spec.distill_model]
    return argv


class _GradProbe:
    """Records DeepSpeed's reduced full gradients at the first optimizer step.

    It wraps the step of the engine's basic optimizer (the torch or CPU Adam that DeepSpeed built from the
    config): DeepSpeed calls it after the gradient reduction (for ZeRO, inside its own step), the one
    moment the final averaged gradient exists on every stage. Every rank assembles every parameter's
    gradient (collectives in the same order). Observation only: the wrapped step runs unchanged.
    """

    def __init__(self, engine):
        self.engine = engine
        self.captured: dict[str, torch.Tensor] | None = None
        optimizer = engine.basic_optimizer
        inner_step = optimizer.step

        def step(*args, **kwargs):
            self.capture()
            return inner_step(*args, **kwargs)

        optimizer.step = step

    def capture(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        opt = self.engine.optimizer
        names = {id(p): n for n, p in self.engine.module.named_parameters()}
        if self.captured is None:
            self.captured = {}
            self._groups_done: set[int] = set()
            if not hasattr(opt, "single_partition_of_fp32_groups"):
                for n, p in self.engine.module.named_parameters():
                    if not p.requires_grad:  # locked: no gradient anywhere (ZeRO-3 holds no optimizer for it)
                        continue
                    g = safe_get_full_grad(p)
                    self.captured[n] = g.detach().float().clone().cpu() if g is not None else None
                return
        if not hasattr(opt, "single_partition_of_fp32_groups"):
            return
        # ZeRO-1/2 step one parameter group at a time, each with only its own gradient present.
        for i, flat in enumerate(opt.single_partition_of_fp32_groups):
            if flat.grad is None or i in self._groups_done:
                continue
            self._groups_done.add(i)
            for p in opt.bit16_groups[i]:
                self.captured[names[id(p)]] = self._zero12_grad(p, flat).cpu()

    @staticmethod
    def _zero12_grad(p, flat: torch.Tensor) -> torch.Tensor:
        # ZeRO-1/2 have already moved the reduced gradient into the flat fp32 partition that the
        # optimizer steps (DeepSpeed's own accessor refuses at this point): read each rank's
        # fragment from there and sum the fragments over the ranks (ds_clip runs data parallel only).
        buf = torch.zeros(p.numel(), dtype=torch.float32)
        m = p._hp_mapping
        if m is not None:
            frag = flat.grad.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel)
            buf.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel).copy_(frag.float().cpu())
        return distributed.all_reduce_sum(buf).view(p.shape)


def full_params(engine) -> dict[str, torch.Tensor]:
    """fp32 master weights of every parameter, on every rank, in open_clip's names and shapes."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            # A locked parameter has no optimizer (no fp32 master): its value is the module's own, gathered
            # under ZeRO-3 (a collective: every rank, same order).
            with deepspeed.zero.GatheredParameters([p]):
                out[n] = p.data.detach().float().clone().cpu()
            continue
        v = safe_get_full_fp32_param(p)
        if v is None:  # ZeRO-0 without a separate master copy
            v = p.data
        out[n] = v.detach().float().clone().cpu()
    return out


def run_in_group(spec: RunSpec) -> RunResult:
    """Train ``spec`` on every rank of the current process group; every rank returns the result.

    The engine and loss are ``ds_clip.engine.build_engine``'s from the flags of ``train_argv(spec)``."""
    import torch.distributed as dist

    from ds_clip.config import parse_settings
    from ds_clip.engine import build_engine, build_model_bundle, resolve_run
    from ds_clip.step import cached_step

    rank, world_size = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as preset_dir:
        s = parse_settings(train_argv(spec, preset_dir))
        geometry, ds = resolve_run(s, world_size)
        bundle = build_model_bundle(s.model, seed=s.data.seed)
        built = build_engine(
            bundle, geometry, ds, model=s.model, optim=s.optim, loss=s.loss, seed=s.data.seed, rank=rank,
            total_steps=FLAT_SCHEDULE_STEPS,
        )  # fmt: skip
    engine, loss_fn, teacher = built.engine, built.loss_fn, built.teacher
    probe = _GradProbe(engine) if spec.capture_grads else None
    engine.train()
    losses, per_step_ops, skipped = [], [], []
    comms = None
    if spec.count_collectives:
        from deepspeed import comm as ds_comm

        comms = ds_comm.comms_logger
    for step in range(spec.steps):
        batches, gids = step_micro_batches(spec, bundle.model_cfg, step, rank, world_size)
        seeds = [micro_batch_seed(spec.seed, step, g) for g in gids]
        if spec.nan_at == (step, rank):
            batches[0] = (torch.full_like(batches[0][0], float("nan")), batches[0][1])
        before = _op_counts(comms) if comms is not None else None
        res = cached_step(
            engine, batches, loss_fn, micro_batch_seeds=seeds, caption=built.caption_fn, teacher=teacher
        )
        if comms is not None:
            after = _op_counts(comms)
            per_step_ops.append(
                {
                    op: {size: n - before.get(op, {}).get(size, 0) for size, n in sizes.items()}
                    for op, sizes in after.items()
                }
            )
        losses.append(float(res.loss))
        skipped.append(res.skipped)
    params = full_params(engine)
    buffers = {
        n: b.detach().float().clone().cpu() for n, b in engine.module.named_buffers() if "running" in n
    }
    result = RunResult(
        spec=spec,
        world_size=world_size,
        losses=losses,
        params=params,
        buffers=buffers,
        grads=probe.captured if probe is not None else None,
        collectives=per_step_ops[-1] if per_step_ops else None,
        num_params=sum(p.numel() for p in params.values()),
        skipped=skipped,
    )
    engine.destroy()
    del engine
    return result


def _op_counts(comms_logger) -> dict[str, dict[int, int]]:
    return {
        op: {size: v[0] for size, v in by_size.items()} for op, by_size in comms_logger.comms_dict.items()
    }


# --------------------------------------------------------------------------- local process groups


def _group_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # A spawned child inherits "spawn" as its default start method, so every DataLoader iterator here would
    # start its workers as fresh interpreters (seconds each: torch, open_clip, deepspeed imported again).
    # The launchers users run (deepspeed, torchrun, mpirun) start ranks as plain processes, whose
    # DataLoaders fork their workers: do what they do.
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)
    from ds_clip.distributed import init_distributed

    init_distributed()
    # Everything imported so far (torch, DeepSpeed, open_clip: millions of objects) lives as long as the
    # process: move it out of the collector's way, so the full collections that many engine builds trigger
    # (DeepSpeed's ZeRO-3 defragment calls gc.collect()) scan only what the runs allocate.
    import gc

    gc.freeze()
    result = fn(*args)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    import torch.distributed as dist

    distributed.barrier()
    dist.destroy_process_group()


def spawn_group(world_size: int, fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world_size`` local processes over gloo; return rank 0's result."""
    import torch.multiprocessing as mp

    from ds_clip.distributed import _free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _group_entry,
            args=(world_size, _free_port(), fn, args, out_dir),
            nprocs=world_size,
            start_method="spawn",
        )
        return torch.load(os.path.join(out_dir, "result.pt"), weights_only=False)


def run_many(specs: Sequence[RunSpec]) -> list[RunResult]:
    """Every rank runs every spec in order (one DeepSpeed engine at a time, one process group)."""
    return [run_in_group(s) for s in specs]


def replace(spec: RunSpec, **changes: Any) -> RunSpec:
    return dataclasses.replace(spec, **changes)


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

    from ds_clip.caption import is_captioning
    from ds_clip.model import TowerLocks, build_model

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


# ------------------------------------------------------------------------------ tiny models (no download)


def coca_config(vision: dict, text: dict) -> dict:
    """open_clip's CoCa around a ViT and a text tower config: an attentional-pool image tower with output
    tokens, a text tower with a CLS token, and a one-block captioning decoder over the text tower's vocabulary
    (open_clip's CoCa needs embed_dim = text width = decoder width)."""
    return {
        "embed_dim": text["width"],
        "custom_text": True,
        "vision_cfg": {
            **vision,
            "attentional_pool": True,
            "attn_pooler_heads": 2,
            "attn_pooler_queries": 4,
            "output_tokens": True,
        },
        "text_cfg": {**text, "embed_cls": True, "output_tokens": True},
        "multimodal_cfg": {
            "context_length": text["context_length"],
            "vocab_size": text["vocab_size"],
            "width": text["width"],
            "heads": text["heads"],
            "layers": 1,
        },
    }


# For runs of the real CLI: the built-in captions go through open_clip's SimpleTokenizer, so the text
# tower needs its full vocabulary.
E2E_MODEL = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

# The tiny CoCa of the trainer and launcher runs (the tokenizer's full vocabulary, as E2E_MODEL).
COCA_E2E_MODEL = coca_config(E2E_MODEL["vision_cfg"], E2E_MODEL["text_cfg"])

TEXT = {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}

# A --distill-model teacher for E2E_MODEL students (the same image size and tokenizer, wider, its own
# embedding size); written with weights by write_pretrained_dir.
E2E_TEACHER = {
    "embed_dim": 24,
    "vision_cfg": {**E2E_MODEL["vision_cfg"], "width": 48, "head_width": 24},
    "text_cfg": {**E2E_MODEL["text_cfg"], "width": 48},
}

VIT_VISION = {
    "image_size": 16,
    "layers": 1,
    "width": 32,
    "patch_size": 8,
    "head_width": 16,
    "patch_dropout": 0.25,
}

COCA = coca_config(VIT_VISION, TEXT)

CONFIGS: dict[str, dict] = {
    # native open_clip ViT with FLIP-style patch dropout (draws from the CPU generator)
    "vit": {
        "embed_dim": 16,
        "vision_cfg": VIT_VISION,
        "text_cfg": TEXT,
    },
    "vit_siglip": {
        "embed_dim": 16,
        "init_logit_bias": -10.0,
        "vision_cfg": VIT_VISION,
        "text_cfg": TEXT,
    },
    # timm tower with nn.Dropout (head) and DropPath (stochastic depth)
    "timm_dropout": {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "timm_model_name": "test_vit",
            "timm_model_pretrained": False,
            "timm_pool": "avg",
            "timm_proj": "linear",
            "timm_drop": 0.2,
            "timm_drop_path": 0.1,
        },
        "text_cfg": TEXT,
    },
    # open_clip's CoCa: attentional-pool image tower with output tokens, a text tower with a CLS token and a
    # one-block captioning decoder over the 64-token vocabulary (its cross-attention reads the image tokens)
    "coca": COCA,
    # open_clip's ModifiedResNet: BatchNorm running statistics
    "resnet_bn": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8},
        "text_cfg": TEXT,
    },
}


# A pretrained model as a LiT fine-tune starts from it: an open_clip folder (config + weights) as
# ds-clip-export writes it; its weights differ from what seed 0 would initialise.
PRETRAINED = {"lit": "vit"}
PRETRAINED_SEED = 1234

# A distillation teacher (--distill-model): the student's inputs (image size, tokenizer), another width and
# embedding size (the distill loss compares N x N logits, not embeddings), its own weights and patch dropout
# in its config, which only a teacher left in train mode would draw.
TEACHER = {
    "embed_dim": 24,
    "vision_cfg": {**VIT_VISION, "width": 48, "head_width": 24},
    "text_cfg": {**TEXT, "width": 48, "heads": 2},
}
TEACHER_SEED = 4321


def write_pretrained_dir(folder: Path, model_cfg: dict, seed: int = PRETRAINED_SEED) -> str:
    """FOLDER/open_clip_config.json and FOLDER/open_clip_model.safetensors of a tiny open_clip model
    initialised from ``seed`` (open_clip's own names and shapes, loaded strictly); 'local-dir:FOLDER'."""
    import open_clip
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}))
    torch.manual_seed(seed)
    model = open_clip.CLIP(**model_cfg)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()},
        str(folder / "open_clip_model.safetensors"),
    )
    return f"local-dir:{folder}"


def write_model_dirs(root: Path) -> dict[str, str]:
    """Write every config as ROOT/NAME/open_clip_config.json, and each PRETRAINED model with weights;
    return NAME -> 'local-dir:...'."""
    names = {}
    for name, cfg in CONFIGS.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
        names[name] = f"local-dir:{d}"
    for name, base in PRETRAINED.items():
        names[name] = write_pretrained_dir(root / name, CONFIGS[base])
    names["teacher"] = write_pretrained_dir(root / "teacher", TEACHER, seed=TEACHER_SEED)
    return names


# ------------------------------------------------------------------------------ the equivalence matrix
# Shared by tests/test_equivalence.py and scripts/equivalence_report.py.

M = 2  # pairs per micro-batch
# BatchNorm normalises with the statistics of each micro-batch; over 2 samples that is ill-conditioned
# enough to amplify fp32 rounding past 1e-5, so the BatchNorm tower gets 4.
BN_M = 4
STEPS = 3
# AdamW turns float noise into full-size updates where the true gradient is ~0 (attention key
# biases get exactly zero gradient: softmax ignores them). eps=1e-4 sits below the typical gradient
# entry of these models (1e-3..1e-1) so real gradients still get Adam's normalised update (a
# gradient counted twice changes the update wherever |g| is near eps), while rounding noise of
# ~1e-9 moves a parameter by at most lr*1e-5.
ADAM = {"lr": 1e-3, "eps": 1e-4}

GLOBAL = LossSpec()
GLOBAL_GWG = LossSpec(gather_with_grad=True)
LOCAL = LossSpec(local_loss=True, gather_with_grad=True)
SIGLIP = LossSpec(siglip=True)
TILED = LossSpec(impl="tiled", tile_size=3)
TILED_LOCAL = LossSpec(local_loss=True, gather_with_grad=True, impl="tiled", tile_size=3)
TILED_SIGLIP = LossSpec(siglip=True, impl="tiled", tile_size=3)


@dataclass(frozen=True)
class Case:
    model: str
    zero_stage: int
    precision: str = "fp32"
    loss: LossSpec = GLOBAL
    offload: bool = False
    grad_checkpointing: bool = False
    lock_image: bool = False
    coalesce: bool = False
    """--coalesce-grad-reduction on: one gradient reduction per step (ZeRO 1-3)."""
    distill: bool = False
    """--distill-model (the TEACHER folder): open_clip's DistillClipLoss, dense or tiled as ``loss`` says."""

    @property
    def name(self) -> str:
        loss = "siglip" if self.loss.siglip else ("local" if self.loss.local_loss else "global")
        if self.loss.gather_with_grad and not self.loss.local_loss:
            loss += "-gwg"
        if self.loss.impl == "tiled":
            loss += "-tiled"
        extra = ("-offload" if self.offload else "") + ("-ckpt" if self.grad_checkpointing else "")
        extra += "-lock-image" if self.lock_image else ""
        extra += "-coalesce" if self.coalesce else ""
        extra += "-distill" if self.distill else ""
        return f"{self.model}-z{self.zero_stage}-{self.precision}-{loss}{extra}"


def _matrix() -> list[Case]:
    cases = []
    for stage in range(4):
        for precision in ("fp32", "bf16"):
            cases.append(Case("vit", stage, precision, GLOBAL))
            cases.append(Case("vit", stage, precision, LOCAL))
            cases.append(Case("vit_siglip", stage, precision, SIGLIP))
    cases += [Case("vit", stage, "fp32", GLOBAL, offload=True) for stage in (1, 2, 3)]
    cases += [Case("vit", stage, "fp32", GLOBAL, grad_checkpointing=True) for stage in (0, 3)]
    cases += [Case("vit", 2, "fp32", GLOBAL_GWG)]
    cases += [
        Case("vit", 0, "fp32", TILED),
        Case("vit", 2, "fp32", TILED),
        Case("vit", 3, "fp32", TILED_LOCAL),
    ]
    cases += [Case("vit_siglip", 1, "fp32", TILED_SIGLIP)]
    cases += [Case("timm_dropout", stage, "fp32", GLOBAL) for stage in (0, 3)]
    cases += [Case("resnet_bn", stage, "fp32", GLOBAL) for stage in (0, 2)]
    # LiT: a pretrained image tower locked (not recomputed in phase 3), the text tower trained.
    cases += [Case("lit", stage, "fp32", GLOBAL, lock_image=True) for stage in (1, 3)]
    # One gradient reduction per step (engine.coalesce_grad_reduction() around the k backwards).
    cases += [Case("vit", stage, "fp32", GLOBAL, coalesce=True) for stage in (1, 2, 3)]
    # CoCa: contrastive + caption (captions of different lengths), the caption mean over the global batch.
    cases += [Case("coca", stage, "fp32", GLOBAL) for stage in range(4)]
    cases += [
        Case("coca", 2, "bf16", GLOBAL),
        Case("coca", 1, "fp32", TILED),
        Case("coca", 3, "fp32", GLOBAL, lock_image=True),
    ]
    # Distillation (a frozen teacher, open_clip's DistillClipLoss): dense on every stage, tiled (global and
    # local rows), and the teacher in bf16 with a bf16 engine.
    cases += [Case("vit", stage, "fp32", GLOBAL, distill=True) for stage in range(4)]
    cases += [Case("vit", 1, "fp32", TILED, distill=True), Case("vit", 3, "fp32", TILED_LOCAL, distill=True)]
    cases += [Case("vit", 2, "bf16", GLOBAL, distill=True)]
    return cases


def fp16_supported() -> bool:
    # DeepSpeed's CPU accelerator runs fp16 only where the CPU has AVX512-FP16 (it answers None
    # otherwise); on a GPU it is True.
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


FP16_CASES = [Case("vit", stage, "fp16", GLOBAL) for stage in (1, 2, 3)]
CASES = _matrix() + (FP16_CASES if fp16_supported() else [])
FP32_CASES = [c for c in CASES if c.precision == "fp32"]
BF16_CASES = [c for c in CASES if c.precision == "bf16"]


def spec_for(case: Case, models: dict[str, str], k: int) -> RunSpec:
    return RunSpec(
        model=models[case.model],
        micro_batch_size=BN_M if case.model == "resnet_bn" else M,
        accum_freq=k,
        steps=STEPS,
        zero_stage=case.zero_stage,
        precision=case.precision,
        offload=case.offload,
        loss=case.loss,
        grad_checkpointing=case.grad_checkpointing,
        lock_image=case.lock_image,
        coalesce="on" if case.coalesce else "off",
        varied_captions=case.model == "coca",
        distill_model=models["teacher"] if case.distill else None,
        capture_grads=True,
        name=case.name,
        **ADAM,
    )


def oracle_errors(result, oracle_grads, floor: float) -> dict[str, float]:
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
