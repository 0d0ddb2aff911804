"""DeepSpeed JSON: a preset (ds_clip.presets, engine settings only) + TrainSettings -> resolved config.

    ds = resolve_deepspeed(settings, world_size=4, accelerator="cuda")   # once, at start
    ds.config, ds.preset, ds.default_reason, ds.coalesce_fallback        # what the engine and the logs read
    ds.refuse_blocked()                                                  # SettingsError if it cannot run here

The preset owns the engine: ZeRO stage and buckets, offload, communication. ds_clip owns everything
that decides what a step computes: batch sizes, accumulation, optimizer, learning rate, precision,
clipping. A preset key that disagrees with a flag is an error naming both; a key that repeats the flag's
value is fine. No deepspeed import here: presets are checked before any process group starts.

Each rule is one function below (batch keys, ZeRO stage and offload, precision, clipping, optimizer,
coalescing, the step's keys). ``resolve_deepspeed`` applies them to a preset and the flags;
``step_engine_config`` applies the ones that concern a user's own config to it, so the two agree.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_clip.presets import OPTIMIZERS, PRESET_DIR, SettingsError, list_presets, load_preset, preset_label

if TYPE_CHECKING:  # duck-typed: ds_clip.config imports this module to check the preset
    from ds_clip.config import OptimSettings, TrainSettings

# Keys the cached accumulation step (ds_clip.step) needs in the engine config. A preset that sets one
# of them to another value is refused. With managed accumulation off, engine.backward() only
# accumulates and engine.step() is the single accumulation boundary: no micro-batch is dropped on
# ZeRO-1/2 and global_samples advances by k*m*W per step.
STEP_ENGINE_KEYS: dict[str, Any] = {"managed_gradient_accumulation": False}

# --coalesce-grad-reduction on (or auto where DeepSpeed allows it): the step wraps its k backward passes in
# engine.coalesce_grad_reduction(), which DeepSpeed allows only with managed accumulation on. Inside the
# block no backward reduces (nor counts as a boundary: the hooks return early), the exit reduces once, and
# engine.step() outside it is the one update; ds_clip.step adds the k-1 micro-batches' samples that managed
# mode leaves out of global_samples.
COALESCE_ENGINE_KEYS: dict[str, Any] = {"managed_gradient_accumulation": True}

# Keys that change what a gradient means; a preset may only repeat the value the step expects
# (STEP_ENGINE_KEYS' value when it sets one, else DeepSpeed's default, which the step assumes).
_GRADIENT_MEANING_DEFAULTS: dict[str, Any] = {
    "gradient_allreduce_op": "mean",  # ranks' gradients averaged; the step's W scaling relies on it
    "managed_gradient_accumulation": True,
}

# Huge: DeepSpeed would otherwise print its own step lines; ds_clip logs samples/s itself.
STEPS_PER_PRINT = 1_000_000_000

# DeepSpeed's DtypeEnum spellings of fp32.
_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


@dataclass(frozen=True)
class _Source:
    """Whose config a rule reads, and how its messages name things: ds-clip-train's preset and flags, or the
    config a user hands ``step_engine_config``."""

    label: str
    """The config in messages: "ds_configs/zero2_bf16.json", a path, or "your DeepSpeed config"."""
    via: str
    """What needs the step's keys: "--accum-freq" or "ds_clip.cached_step"."""
    accum_hint: str
    """What to do instead of DeepSpeed's gradient_accumulation_steps."""
    coalesce_request: str
    """How the request to coalesce is spelled: "--coalesce-grad-reduction on" or "coalesce=True"."""
    coalesce_fix: str = ""
    """Appended to a refused coalesce request."""


def _trainer_source(preset: str) -> _Source:
    return _Source(
        label=preset_label(preset),
        via="--accum-freq",
        accum_hint="ds_clip accumulates itself with exact cached features; use --accum-freq instead",
        coalesce_request="--coalesce-grad-reduction on",
        coalesce_fix="; use off or auto",
    )


_USER_SOURCE = _Source(
    label="your DeepSpeed config",
    via="ds_clip.cached_step",
    accum_hint="cached_step runs the k micro-batches of a step itself (exactly); set it to 1 and pass them to "
    "cached_step",
    coalesce_request="coalesce=True",
)


@dataclass(frozen=True)
class _Zero:
    """What the zero_optimization section says: the stage and where the optimizer and parameters live."""

    stage: Any
    offload_optimizer: str
    offload_param: str

    @property
    def cpu_optimizer(self) -> bool:
        return self.offload_optimizer in ("cpu", "nvme")


# ----------------------------------------------------------------------------------------------- helpers


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _js(value: Any) -> str:
    return json.dumps(value)


def _conflict(key: str, value: Any, label: str, flag: str, flag_value: Any) -> SettingsError:
    return SettingsError(f"{key}={_js(value)} in {label} conflicts with {flag} {flag_value}")


def _step_conflict(key: str, value: Any, src: _Source, expected: Any) -> SettingsError:
    return SettingsError(
        f"{key}={_js(value)} in {src.label} conflicts with ds_clip's accumulation step "
        f"(needs {_js(expected)}; {src.via}): remove it"
    )


def _json_object(cfg: dict[str, Any], key: str, label: str) -> None:
    if key in cfg and not isinstance(cfg[key], dict):
        raise SettingsError(f"{key} in {label} must be a JSON object")


# ------------------------------------------------------------------------------------------------ rules


def _check_no_accumulation(value: Any, src: _Source) -> None:
    """DeepSpeed's own accumulation stays off: ds_clip's step runs the k micro-batches of a step itself."""
    if not _same(value, 1):
        raise SettingsError(f"gradient_accumulation_steps={_js(value)} in {src.label}: {src.accum_hint}")


def _batch_keys(cfg: dict[str, Any], src: _Source, m: int, world_size: int | None) -> None:
    """Take the batch keys out of a preset: m per rank per pass, one engine step per pass (they are written
    back for the world size at the end, ``_engine_batch``); a preset may only repeat them."""
    label = src.label
    _check_no_accumulation(cfg.pop("gradient_accumulation_steps", 1), src)
    mb = cfg.pop("train_micro_batch_size_per_gpu", m)
    if not _same(mb, m):
        raise _conflict("train_micro_batch_size_per_gpu", mb, label, "--batch-size", m)
    tbs = cfg.pop("train_batch_size", None)
    if tbs is not None and world_size is None and not (isinstance(tbs, int) and tbs >= m and tbs % m == 0):
        raise SettingsError(
            f"train_batch_size={_js(tbs)} in {label} is not a multiple of --batch-size {m}: drop it"
        )
    if tbs is not None and world_size is not None and not _same(tbs, m * world_size):
        raise SettingsError(
            f"train_batch_size={_js(tbs)} in {label} is not --batch-size x world size = {m} x {world_size}: "
            f"drop it; {src.accum_hint}"
        )
    if "elasticity" in cfg:
        raise SettingsError(
            f"elasticity in {label}: it changes batch sizes, which come from --batch-size/--accum-freq"
        )


def _read_zero(zero: dict[str, Any], label: str) -> _Zero:
    """The stage and the offload devices of a zero_optimization section (DeepSpeed's defaults: 0, none)."""
    offload: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            raise SettingsError(f"zero_optimization.{key} in {label} must be a JSON object")
        offload[key] = section.get("device", "none")
    return _Zero(zero.get("stage", 0), offload["offload_optimizer"], offload["offload_param"])


def _zero_stage(cfg: dict[str, Any], label: str, s: TrainSettings) -> _Zero:
    """--zero-stage over the preset's stage (CLI > preset); what each stage and offload allow."""
    dist = s.dist
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SettingsError(f"zero_optimization in {label} must be a JSON object")
    if dist.zero_stage is not None:
        zero["stage"] = dist.zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise SettingsError(f"zero_optimization.stage={_js(stage)} in {label} must be 0, 1, 2 or 3")
    if s.model.torchcompile and stage == 3:
        # DeepSpeed 0.19.8's engine.compile traces the model with ZeRO-3's partitioned parameters (its gather
        # hooks do not run inside the traced forward): dynamo fails on the empty shards ("b must be 2D").
        source = "--zero-stage" if dist.zero_stage is not None else label
        raise SettingsError(
            f"--torchcompile does not work with ZeRO stage 3 (from {source}; DeepSpeed 0.19.8 compiles the "
            "model with its partitioned, empty parameters): use --zero-stage 0, 1 or 2, or drop --torchcompile"
        )
    facts = _read_zero(zero, label)
    if facts.offload_optimizer != "none" and stage == 0:
        raise SettingsError(
            f"zero_optimization.offload_optimizer in {label} needs ZeRO stage 1, 2 or 3, not 0"
        )
    if facts.offload_param != "none" and stage != 3:
        raise SettingsError(f"zero_optimization.offload_param in {label} needs ZeRO stage 3, not {stage}")
    return facts


def _refuse_fp16_on_zero0(precision: str, stage: Any, what: str, fix: str) -> None:
    """fp16 on ZeRO stage 0 trains wrongly in DeepSpeed 0.19.x (``what`` names the settings, ``fix`` the way
    out, in the words of whoever set them)."""
    if precision == "fp16" and stage == 0:
        raise SettingsError(
            f"{what}: DeepSpeed 0.19.x gives updates ~loss-scale times too small there (upstream PR #8393 "
            f"open); use {fix}"
        )


def _precision(cfg: dict[str, Any], label: str, s: TrainSettings, stage: Any) -> None:
    """Exactly the section --precision names is enabled (a preset may repeat it, not contradict it)."""
    precision = s.dist.precision
    if "bfloat16" in cfg:  # DeepSpeed's old spelling; it reads it only when "bf16" is absent
        if "bf16" in cfg:
            raise SettingsError(f"{label} has both bf16 and bfloat16 sections: keep bf16")
        cfg["bf16"] = cfg.pop("bfloat16")
    for key, wanted in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        section = cfg.setdefault(key, {})
        if not isinstance(section, dict):
            raise SettingsError(f"{key} in {label} must be a JSON object")
        if "enabled" in section and not _same(section["enabled"], wanted):
            raise _conflict(f"{key}.enabled", section["enabled"], label, "--precision", precision)
        section["enabled"] = wanted
    if cfg["fp16"]["enabled"]:
        cfg["fp16"].setdefault("loss_scale", 0)  # 0: dynamic loss scaling
        flagged = ", --zero-stage 0" if s.dist.zero_stage == 0 else ""
        _refuse_fp16_on_zero0(
            precision, stage, f"--precision fp16 with ZeRO stage 0 ({label}{flagged})",
            "--precision bf16 or --zero-stage 1, 2 or 3",
        )  # fmt: skip
    autocast = cfg.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        raise _conflict("torch_autocast.enabled", True, label, "--precision", precision)


def _enabled_precision(cfg: dict[str, Any]) -> str:
    """The precision a user's config enables: "bf16", "fp16" or "fp32"."""

    def enabled(key: str) -> bool:
        return bool(cfg.get(key, {}).get("enabled", False))

    return "bf16" if enabled("bf16") or enabled("bfloat16") else ("fp16" if enabled("fp16") else "fp32")


def _clipping(cfg: dict[str, Any], label: str, grad_clip_norm: float | None) -> None:
    clip = 0.0 if grad_clip_norm is None else float(grad_clip_norm)
    if "gradient_clipping" in cfg and not _same(cfg["gradient_clipping"], clip):
        raise _conflict(
            "gradient_clipping", cfg["gradient_clipping"], label, "--grad-clip-norm", grad_clip_norm
        )
    cfg["gradient_clipping"] = clip


def optimizer_block(o: OptimSettings) -> tuple[str, dict[str, Any]]:
    """--opt -> DeepSpeed's optimizer "type" and the params it takes from the flags (each optimizer only
    the hyper-parameters its class has; per-group lr and weight_decay come with the parameter groups)."""
    params: dict[str, Any] = {"lr": o.lr, "weight_decay": o.wd}
    if o.optimizer in ("adamw", "lamb", "lion"):
        params["betas"] = [o.beta1, o.beta2]
    if o.optimizer in ("adamw", "lamb"):
        params["eps"] = o.eps
    if o.optimizer == "sgd":
        params["momentum"] = 0.0 if o.momentum is None else o.momentum
    return OPTIMIZERS[o.optimizer], params


# A preset's optimizer params that repeat a flag, and AdamW's engine choices (which kernel runs the same update).
_OPTIMIZER_FLAGS = {
    "lr": "--lr", "betas": "--beta1/--beta2", "eps": "--eps", "weight_decay": "--wd", "momentum": "--momentum"
}  # fmt: skip
_ADAMW_ENGINE_CHOICES = ("torch_adam", "foreach", "fused", "fp32_optimizer_states", "adam_w_mode")


def _preset_optimizer_params(
    preset_opt: Any, label: str, o: OptimSettings, ds_type: str, params: dict
) -> None:
    """A preset's optimizer block must name --opt's optimizer and repeat the flags' values; AdamW's kernel
    choices pass on into ``params``."""
    if not isinstance(preset_opt, dict):
        raise SettingsError(f"optimizer in {label} must be a JSON object")
    opt_type = preset_opt.get("type", "AdamW")
    if str(opt_type).lower() != ds_type.lower():
        raise _conflict("optimizer.type", opt_type, label, "--opt", o.optimizer)
    for key, value in (preset_opt.get("params") or {}).items():
        if key in _OPTIMIZER_FLAGS and key in params:
            if not _same(value, params[key]):
                shown = params[key] if key != "betas" else f"{o.beta1}/{o.beta2}"
                raise _conflict(f"optimizer.params.{key}", value, label, _OPTIMIZER_FLAGS[key], shown)
        elif key == "adam_w_mode" and not value:
            raise _conflict("optimizer.params.adam_w_mode", value, label, "--wd", "(decoupled AdamW decay)")
        elif o.optimizer == "adamw" and key in _ADAMW_ENGINE_CHOICES:
            params[key] = value  # engine choices: which Adam kernel runs the same update
        else:
            raise SettingsError(
                f"optimizer.params.{key} in {label} is not an engine setting ds_clip passes on: remove it"
            )


def _optimizer(cfg: dict[str, Any], label: str, o: OptimSettings, zero: _Zero) -> None:
    """--opt from the flags (DeepSpeed builds it from the JSON); the LR schedule is ds_clip's own."""
    if "scheduler" in cfg:
        raise SettingsError(
            f"scheduler in {label}: ds_clip runs its own LR schedule (--lr-scheduler, --lr, --warmup); "
            "remove the scheduler section"
        )
    ds_type, params = optimizer_block(o)
    if o.optimizer == "lamb" and zero.cpu_optimizer:
        raise SettingsError(
            f"--opt lamb with zero_optimization.offload_optimizer in {label}: DeepSpeed 0.19.8 builds FusedLamb, "
            "a CUDA kernel with no CPU version, for the offloaded states: use an optimizer without offload or "
            "--opt adamw or lion"
        )
    if cfg.get("optimizer") is not None:
        _preset_optimizer_params(cfg["optimizer"], label, o, ds_type, params)
    # torch.optim.AdamW runs anywhere (FusedAdam needs a CUDA build); with the optimizer offloaded to the
    # CPU, DeepSpeed's own CPU Adam is much faster, and torch_adam would take precedence over it.
    if not zero.cpu_optimizer and o.optimizer == "adamw":
        params.setdefault("torch_adam", True)
    # torch's AdamW defaults to its per-tensor loop on CPU tensors: six passes over the parameters, moments and
    # gradients per step (2.5 s for ViT-B-32's 151M parameters on one core, more than its forward and backward
    # at m=4). Its fused kernel (CPU and CUDA) runs the same AdamW update in one pass per tensor, 3x faster here;
    # DeepSpeed hands "fused" to torch.optim.AdamW with the other params. A preset's "foreach" choice stands.
    if params.get("torch_adam") and "foreach" not in params:
        params.setdefault("fused", True)
    cfg["optimizer"] = {"type": ds_type, "params": params}


def _coalesce_blocker(cfg: dict[str, Any], zero: _Zero, precision: str, label: str) -> str | None:
    """Why DeepSpeed 0.19.8's engine.coalesce_grad_reduction() would refuse this engine, or None.

    It needs a ZeRO 1-3 optimizer (DeepSpeedZeroOptimizer / _Stage3: the classes with the coalescing hooks)
    and managed accumulation. DeepSpeed picks BF16_Optimizer instead on ZeRO-1 with bf16 weights, fp32
    gradient accumulation (data_types.grad_accum_dtype) and no optimizer offload
    (engine._do_optimizer_sanity_check): that wrapper raises NotImplementedError.
    """
    if zero.stage == 0:
        return (
            "ZeRO stage 0 has no ZeRO optimizer, and DeepSpeed coalesces on ZeRO 1-3 only "
            "(ZeRO-0 reduces once per step anyway)"
        )
    if "managed_gradient_accumulation" in cfg and not _same(cfg["managed_gradient_accumulation"], True):
        return (
            f"managed_gradient_accumulation={_js(cfg['managed_gradient_accumulation'])} in {label}: "
            "DeepSpeed coalesces only under its managed accumulation"
        )
    data_types = cfg.get("data_types") or {}
    accum = str(data_types.get("grad_accum_dtype", "")).lower() if isinstance(data_types, dict) else ""
    if zero.stage == 1 and precision == "bf16" and zero.offload_optimizer == "none" and accum in _FP32_NAMES:
        return (
            f"data_types.grad_accum_dtype={_js(data_types['grad_accum_dtype'])} in {label} with bf16 on ZeRO-1 "
            "makes DeepSpeed wrap the optimizer in BF16_Optimizer, which coalesce_grad_reduction rejects"
        )
    return None


def _coalescing(
    cfg: dict[str, Any], mode: str, zero: _Zero, precision: str, src: _Source
) -> tuple[dict[str, Any], str | None]:
    """One gradient reduction per step ("on", "auto", "off"): the step keys the engine needs, and why
    DeepSpeed cannot coalesce here (None where it can or where it was not asked to). "on" where it cannot is
    refused."""
    blocker = None if mode == "off" else _coalesce_blocker(cfg, zero, precision, src.label)
    if mode == "on" and blocker is not None:
        raise SettingsError(f"{src.coalesce_request}: {blocker}{src.coalesce_fix}")
    required = dict(STEP_ENGINE_KEYS)
    if mode != "off" and blocker is None:
        required.update(COALESCE_ENGINE_KEYS)
    return required, blocker


def _merge_step_keys(cfg: dict[str, Any], required: dict[str, Any], src: _Source, prefix: str = "") -> None:
    """Deep-merge the step's keys into cfg; a leaf set to another value is an error."""
    for key, value in required.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            _merge_step_keys(cfg[key], value, src, f"{prefix}{key}.")
            continue
        if key in cfg and not _same(cfg[key], value):
            raise _step_conflict(prefix + key, cfg[key], src, value)
        cfg[key] = copy.deepcopy(value)


def _step_keys(cfg: dict[str, Any], required: dict[str, Any], src: _Source) -> None:
    """The keys the accumulation step relies on: what it requires, and DeepSpeed's defaults of the keys that
    change what a gradient means (a config may repeat them, not change them)."""
    for key, expected in _GRADIENT_MEANING_DEFAULTS.items():
        if key not in required and key in cfg and not _same(cfg[key], expected):
            raise _step_conflict(key, cfg[key], src, expected)
    _merge_step_keys(cfg, required, src)


def _engine_batch(cfg: dict[str, Any], m: int, world_size: int) -> None:
    """Every engine step is one micro-batch of m pairs per rank; ds_clip's step runs the k of a step itself."""
    cfg["train_micro_batch_size_per_gpu"] = m
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_batch_size"] = m * world_size


def _quiet_engine(cfg: dict[str, Any]) -> None:
    cfg.setdefault("steps_per_print", STEPS_PER_PRINT)  # a preset may ask for DeepSpeed's prints
    cfg.setdefault("wall_clock_breakdown", False)  # a preset may ask for DeepSpeed's timers
    cfg["zero_allow_untested_optimizer"] = True  # torch AdamW under ZeRO is "untested" to DeepSpeed


# ---------------------------------------------------------------------------------- what runs where


def optimizer_blocker(optimizer: str, *, offloaded: bool, accelerator: str) -> str | None:
    """Why DeepSpeed 0.19.8 cannot build --opt on this accelerator ("cuda", "cpu", ...), else None.

    Measured on the CPU accelerator: "Lamb" builds FusedLamb and "Lion" FusedLion, CUDA kernels the CPU
    accelerator does not implement ("This op had not been implemented on CPU backend"); with the optimizer
    offloaded ("offloaded") "Lion" builds DeepSpeedCPULion (a C++ op, compiled on first use). AdamW and SGD
    run anywhere.
    """
    if accelerator == "cuda":
        return None
    if optimizer == "lamb":
        return (
            f"--opt lamb: DeepSpeed 0.19.8 builds FusedLamb, a CUDA kernel, and this machine's accelerator is "
            f"{accelerator}: use --opt adamw, lion (with an offload preset) or sgd, or a CUDA machine"
        )
    if optimizer == "lion" and not offloaded:
        return (
            f"--opt lion: on the {accelerator} accelerator DeepSpeed 0.19.8 has only its CPU Lion, used when the "
            "optimizer is offloaded: add --ds-config zero2_offload_fp32 (or another *_offload_* preset)"
        )
    return None


def bn_sync_blocker(use_bn_sync: bool, accelerator: str) -> str | None:
    """Why --use-bn-sync cannot run here, else None: torch's SyncBatchNorm forward refuses CPU tensors whenever
    a process group exists, one rank included (torch.nn.SyncBatchNorm.forward: "expected input tensor to be on
    GPU"; measured with torch 2.14)."""
    if not use_bn_sync or accelerator != "cpu":
        return None
    return (
        "--use-bn-sync on the CPU: torch's SyncBatchNorm runs on GPUs only (its forward refuses CPU tensors); "
        "drop it (each rank then normalises with its own micro-batch) or run on GPUs"
    )


# ------------------------------------------------------------------------------------ the resolution


def default_preset(s: TrainSettings, world_size: int | None) -> tuple[str, str]:
    """The preset ds-clip-train runs without --ds-config, and why (one log line): where the default is decided.

    ZeRO-1 (``zero1_<precision>``) partitions the optimizer state over the W ranks. One process has nothing to
    partition it with, and ZeRO-1 there still costs a flattened copy of every gradient and of every updated
    parameter per step (about 2x open_clip's step for ViT-B-32 at k=1 on a CPU, docs/benchmarks.md), so W = 1
    defaults to ZeRO-0, unless a flag needs ZeRO: --zero-stage (then the ZeRO-1 preset's buckets with that
    stage, as before), --coalesce-grad-reduction on (ZeRO 1-3 only) or --precision fp16 (refused on ZeRO-0).
    ``world_size`` None (validation, before the process group): the multi-rank default, whose checks cover
    ZeRO-0's.
    """
    p = s.dist.precision
    if world_size != 1:
        why = f"{world_size or 'W'} ranks: ZeRO-1 partitions the optimizer state over them"
        return f"zero1_{p}", why
    if s.dist.zero_stage is not None:
        return f"zero1_{p}", f"one process, --zero-stage {s.dist.zero_stage} on this preset's ZeRO settings"
    if s.dist.coalesce_grad_reduction == "on":
        return f"zero1_{p}", "one process, but --coalesce-grad-reduction on needs ZeRO 1-3"
    if p == "fp16":
        return (
            f"zero1_{p}",
            "one process, but fp16 needs ZeRO 1-3 (DeepSpeed 0.19 gets ZeRO-0 fp16 updates wrong)",
        )
    return f"zero0_{p}", (
        "one process: nothing to partition the optimizer state with, and ZeRO-1 would copy every gradient and "
        "parameter once more per step (--zero-stage N or --ds-config NAME to choose)"
    )


@dataclass(frozen=True)
class ResolvedDeepSpeed:
    """The DeepSpeed side of a run, resolved once from the preset and the flags and then only read: the JSON
    ``deepspeed.initialize`` gets (and ds_config.json holds), which preset and why, what
    ``--coalesce-grad-reduction auto`` fell back to, and what this machine's accelerator cannot run."""

    json_text: str
    """The resolved JSON, indented as ds_config.json holds it (a string: the value cannot change)."""
    preset: str
    """The preset's name or path (--ds-config, else the default)."""
    default_reason: str | None
    """Why this preset, when --ds-config was left out (``default_preset``); None when the user chose it."""
    coalesce_fallback: str | None
    """Why ``--coalesce-grad-reduction auto`` runs without coalescing here; None otherwise."""
    world_size: int | None
    """The W the batch keys were resolved for; None: not known yet (validation), no batch keys."""
    accelerator: str | None = None
    """The accelerator the blockers were decided for ("cuda", "cpu", ...); None: not decided."""
    optimizer_blocker: str | None = None
    """Why DeepSpeed cannot build --opt on ``accelerator`` (``optimizer_blocker``), else None."""
    bn_sync_blocker: str | None = None
    """Why --use-bn-sync cannot run on ``accelerator`` (``bn_sync_blocker``), else None."""

    @property
    def config(self) -> dict[str, Any]:
        """The resolved JSON as a new dict (for ``deepspeed.initialize(config=...)``; yours to change)."""
        return json.loads(self.json_text)

    def refuse_blocked(self) -> None:
        """SettingsError with the first reason this machine cannot run the settings (before DeepSpeed fails
        inside its op builder, or torch in the first forward)."""
        for why_not in (self.optimizer_blocker, self.bn_sync_blocker):
            if why_not is not None:
                raise SettingsError(why_not)


def resolve_deepspeed(
    s: TrainSettings, world_size: int | None, *, accelerator: str | None = None
) -> ResolvedDeepSpeed:
    """Preset + flags -> the resolved DeepSpeed side of a run; SettingsError naming the key and flag that
    disagree.

    ``world_size`` None (validation, before any process group): every rule but the batch keys' world size.
    With the world size, the JSON has train_batch_size = m * W and gradient_accumulation_steps = 1: every
    engine step is one micro-batch; ds_clip's step runs the k micro-batches of an optimizer step itself.
    ``accelerator`` (``ds_clip.distributed.accelerator_name()``): also decide what it cannot run.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    o, dist = s.optim, s.dist
    default_reason = None
    if dist.ds_config is None:
        preset, default_reason = default_preset(s, world_size)
    else:
        preset = dist.ds_config
    src = _trainer_source(preset)
    cfg = copy.deepcopy(load_preset(preset))
    _batch_keys(cfg, src, o.batch_size, world_size)
    zero = _zero_stage(cfg, src.label, s)
    _precision(cfg, src.label, s, zero.stage)
    _clipping(cfg, src.label, o.grad_clip_norm)
    _optimizer(cfg, src.label, o, zero)
    required, blocker = _coalescing(cfg, dist.coalesce_grad_reduction, zero, dist.precision, src)
    _step_keys(cfg, required, src)
    if world_size is not None:
        _engine_batch(cfg, o.batch_size, world_size)
    _quiet_engine(cfg)
    blockers: dict[str, str | None] = {}
    if accelerator is not None:
        blockers = dict(
            optimizer_blocker=optimizer_blocker(
                o.optimizer, offloaded=zero.cpu_optimizer, accelerator=accelerator
            ),
            bn_sync_blocker=bn_sync_blocker(s.model.use_bn_sync, accelerator),
        )
    return ResolvedDeepSpeed(
        json_text=json.dumps(cfg, indent=2),
        preset=preset,
        default_reason=default_reason,
        coalesce_fallback=blocker if dist.coalesce_grad_reduction == "auto" else None,
        world_size=world_size,
        accelerator=accelerator,
        **blockers,
    )


def check_preset(s: TrainSettings) -> None:
    """Raise SettingsError if the preset is missing, unreadable or disagrees with the flags.

    Called from config.validate before the world size is known; train_batch_size is checked at start.
    """
    resolve_deepspeed(s, world_size=None)


def resolve_ds_config(s: TrainSettings, world_size: int) -> dict[str, Any]:
    """The resolved JSON alone (``resolve_deepspeed(s, world_size).config``), for a look at what a launch of
    ``world_size`` ranks would run."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return resolve_deepspeed(s, world_size).config


def step_engine_config(config: dict[str, Any], *, coalesce: bool = False) -> dict[str, Any]:
    """Your own DeepSpeed config, made fit for ``ds_clip.cached_step`` in your own loop (a new dict).

    The engine's batch is one micro-batch of m pairs per rank (``train_micro_batch_size_per_gpu``); the step
    runs the k micro-batches of an optimizer step itself. So the result has ``gradient_accumulation_steps``
    1 and ``STEP_ENGINE_KEYS`` merged in (managed accumulation off: each ``engine.backward`` accumulates,
    ``engine.step()`` is the one boundary); with ``coalesce=True``, ``COALESCE_ENGINE_KEYS`` instead (one
    gradient reduction per step, ZeRO 1-3, as ``--coalesce-grad-reduction on``). Everything else (optimizer,
    scheduler, ZeRO, precision, clipping) stays yours. Refused with a ``SettingsError`` naming the key:
    ``gradient_accumulation_steps`` other than 1, ``train_batch_size`` next to
    ``train_micro_batch_size_per_gpu`` (DeepSpeed derives it as m x world size), a step key or
    ``gradient_allreduce_op`` with another value than the step needs, fp16 on ZeRO stage 0, and
    ``coalesce=True`` where DeepSpeed cannot coalesce. The same rules as ds-clip-train's resolution.
    """
    src = _USER_SOURCE
    label = src.label
    cfg = copy.deepcopy(config)
    _check_no_accumulation(cfg.get("gradient_accumulation_steps", 1), src)
    cfg["gradient_accumulation_steps"] = 1
    if "train_batch_size" in cfg and "train_micro_batch_size_per_gpu" in cfg:
        raise SettingsError(
            f"train_batch_size={_js(cfg['train_batch_size'])} in {label}: with cached_step the engine's batch "
            "is one micro-batch per rank; keep train_micro_batch_size_per_gpu (m) alone, DeepSpeed derives "
            "train_batch_size = m x world size"
        )
    for key in ("zero_optimization", "bf16", "bfloat16", "fp16"):
        _json_object(cfg, key, label)
    zero = _read_zero(cfg.get("zero_optimization", {}), label)
    precision = _enabled_precision(cfg)
    _refuse_fp16_on_zero0(
        precision, zero.stage, f"fp16 with ZeRO stage 0 in {label}", "bf16 or ZeRO stage 1, 2 or 3"
    )
    required, _ = _coalescing(cfg, "on" if coalesce else "off", zero, precision, src)
    _step_keys(cfg, required, src)
    return cfg


def write_run_files(run_dir: Path, settings: dict[str, Any], ds: ResolvedDeepSpeed) -> None:
    """Write settings.json (`config.settings_to_dict`) and ds_config.json (the resolved JSON, indented) into
    the run folder. Rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    (run_dir / "ds_config.json").write_text(ds.json_text + "\n")


__all__ = [
    "PRESET_DIR",  # re-exported from ds_clip.presets, where the preset files are found
    "COALESCE_ENGINE_KEYS",
    "STEP_ENGINE_KEYS",
    "ResolvedDeepSpeed",
    "SettingsError",
    "bn_sync_blocker",
    "check_preset",
    "default_preset",
    "list_presets",
    "load_preset",
    "optimizer_block",
    "optimizer_blocker",
    "preset_label",
    "resolve_deepspeed",
    "resolve_ds_config",
    "step_engine_config",
    "write_run_files",
]
