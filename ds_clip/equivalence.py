"""Train the same steps under different (W ranks, k micro-batches) splits, for tests and the demo.

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
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_clip.loss import ContrastiveLoss, LossSpec
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
    optimizer: str = "adamw"
    """'adamw' (torch AdamW, weight decay 0) or 'sgd' (plain SGD, no momentum)."""
    lr: float = 1e-3
    eps: float = 1e-8
    seed: int = 0
    capture_grads: bool = False
    """Record the full-batch gradient of every parameter at the first step (as DeepSpeed holds it)."""
    nan_at: tuple[int, int] | None = None
    """(step, rank): feed NaN images to that rank's first micro-batch at that step (fault tests)."""
    count_collectives: bool = False
    """Count DeepSpeed collectives per step with DeepSpeed's comms logger."""
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
    indices: Sequence[int], *, image_size: int, context_length: int, vocab_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image-text pairs defined by global sample index alone (16 latent classes, so the loss can fall)."""
    images, texts = [], []
    for idx in indices:
        g = torch.Generator().manual_seed(seed * 7_919 + int(idx))
        cls = int(idx) % 16
        proto = torch.Generator().manual_seed(seed * 104_729 + cls)
        image = torch.randn(3, image_size, image_size, generator=proto) + 0.5 * torch.randn(
            3, image_size, image_size, generator=g
        )
        length = max(2, context_length // 2)
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
            )
        )
        ids.append(g)
    return batches, ids


def ds_config_for(spec: RunSpec, world_size: int) -> dict:
    from ds_clip.ds_config import STEP_ENGINE_KEYS

    zero: dict[str, Any] = {"stage": spec.zero_stage}
    if spec.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if spec.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "train_batch_size": spec.micro_batch_size * world_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise
        **STEP_ENGINE_KEYS,
    }
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    if spec.count_collectives:
        cfg["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}
    return cfg


class _GradProbe:
    """Records DeepSpeed's reduced full gradients at the first optimizer step.

    It wraps the client optimizer's ``step``: DeepSpeed calls that after the gradient reduction
    (for ZeRO, inside its own step), the one moment the final averaged gradient exists on every
    stage. Every rank assembles every parameter's gradient (collectives in the same order).
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.engine = None
        self.captured: dict[str, torch.Tensor] | None = None
        inner_step = optimizer.step

        def step(*args, **kwargs):
            if self.engine is not None:  # some wrappers step once while the engine is being built
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
        # fragment from there and sum the fragments over the data-parallel group.
        import torch.distributed as dist

        buf = torch.zeros(p.numel(), dtype=torch.float32)
        m = p._hp_mapping
        if m is not None:
            frag = flat.grad.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel)
            buf.narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel).copy_(frag.float().cpu())
        buf = buf.to(p.device)
        dist.all_reduce(buf, group=p._dp_group)
        return buf.view(p.shape)


def full_params(engine) -> dict[str, torch.Tensor]:
    """fp32 master weights of every parameter, on every rank, in open_clip's names and shapes."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        v = safe_get_full_fp32_param(p)
        if v is None:  # ZeRO-0 without a separate master copy
            v = p.data
        out[n] = v.detach().float().clone().cpu()
    return out


def run_in_group(spec: RunSpec) -> RunResult:
    """Train ``spec`` on every rank of the current process group; every rank returns the result."""
    import deepspeed
    import torch.distributed as dist

    from ds_clip.model import build_model, param_groups, prepare_for_deepspeed
    from ds_clip.step import cached_step

    rank, world_size = dist.get_rank(), dist.get_world_size()
    bundle = build_model(spec.model, seed=spec.seed, grad_checkpointing=spec.grad_checkpointing)
    model = bundle.model
    prepare_for_deepspeed(model)
    groups = param_groups(model, weight_decay=0.0)
    if spec.optimizer == "sgd":
        opt = torch.optim.SGD(groups, lr=spec.lr)
    else:
        opt = torch.optim.AdamW(groups, lr=spec.lr, eps=spec.eps, betas=(0.9, 0.98))
    probe = _GradProbe(opt) if spec.capture_grads else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config_for(spec, world_size))
    if probe is not None:
        probe.engine = engine
    loss_fn = ContrastiveLoss(spec.loss, rank=rank, world_size=world_size)
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
        res = cached_step(engine, batches, loss_fn, micro_batch_seeds=seeds)
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
    from ds_clip.distributed import init_distributed

    init_distributed()
    result = fn(*args)
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    import torch.distributed as dist

    dist.barrier()
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
    size 1) is backpropagated: the definition of the full-batch gradient ds_clip promises.
    """
    from open_clip.loss import ClipLoss, SigLipLoss

    from ds_clip.model import build_model

    bundle = build_model(spec.model, seed=spec.seed, grad_checkpointing=spec.grad_checkpointing)
    model = bundle.model.train()
    images, texts, out = [], [], None
    for r in range(world_size):
        batches, gids = step_micro_batches(spec, bundle.model_cfg, 0, r, world_size)
        for (img, txt), g in zip(batches, gids):
            torch.manual_seed(micro_batch_seed(spec.seed, 0, g))
            out = model(image=img, text=txt)
            images.append(out["image_features"])
            texts.append(out["text_features"])
    image, text = torch.cat(images), torch.cat(texts)
    if spec.loss.siglip:
        loss = SigLipLoss()(image, text, out["logit_scale"], out["logit_bias"])
    else:
        loss = ClipLoss()(image, text, out["logit_scale"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())
