"""The rules that make a DeepSpeed config fit ds_clip's cached accumulation step, one function each: batch
keys, ZeRO stage and offload, precision, clipping, optimizer, coalescing, the step's keys.

ds_clip.ds_config applies them in order: all of them to a preset and the flags (``resolve_deepspeed``), the
ones that concern a config of the user's own to it (``step_engine_config``), so the two agree. A rule reads
and changes the config dict it is given and raises a SettingsError naming the key, the config (``Source``)
and the flag. No deepspeed import: the rules run at validation, before any process group starts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ds_clip.presets import OPTIMIZERS, SettingsError, preset_label

if TYPE_CHECKING:  # duck-typed: ds_clip.config imports ds_clip.ds_config to check the preset
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
class Source:
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


def trainer_source(preset: str) -> Source:
    return Source(
        label=preset_label(preset),
        via="--accum-freq",
        accum_hint="ds_clip accumulates itself with exact cached features; use --accum-freq instead",
        coalesce_request="--coalesce-grad-reduction on",
        coalesce_fix="; use off or auto",
    )


USER_SOURCE = Source(
    label="your DeepSpeed config",
    via="ds_clip.cached_step",
    accum_hint="cached_step runs the k micro-batches of a step itself (exactly); set it to 1 and pass them to "
    "cached_step",
    coalesce_request="coalesce=True",
)


@dataclass(frozen=True)
class ZeroFacts:
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


def js(value: Any) -> str:
    return json.dumps(value)


def _conflict(key: str, value: Any, label: str, flag: str, flag_value: Any) -> SettingsError:
    return SettingsError(f"{key}={js(value)} in {label} conflicts with {flag} {flag_value}")


def _step_conflict(key: str, value: Any, src: Source, expected: Any) -> SettingsError:
    return SettingsError(
        f"{key}={js(value)} in {src.label} conflicts with ds_clip's accumulation step "
        f"(needs {js(expected)}; {src.via}): remove it"
    )


def json_object(cfg: dict[str, Any], key: str, label: str) -> None:
    if key in cfg and not isinstance(cfg[key], dict):
        raise SettingsError(f"{key} in {label} must be a JSON object")


# ------------------------------------------------------------------------------------------------ rules


def check_no_accumulation(value: Any, src: Source) -> None:
    """DeepSpeed's own accumulation stays off: ds_clip's step runs the k micro-batches of a step itself."""
    if not _same(value, 1):
        raise SettingsError(f"gradient_accumulation_steps={js(value)} in {src.label}: {src.accum_hint}")


def batch_keys(cfg: dict[str, Any], src: Source, m: int, world_size: int | None) -> None:
    """Take the batch keys out of a preset: m per rank per pass, one engine step per pass (they are written
    back for the world size at the end, ``engine_batch``); a preset may only repeat them."""
    label = src.label
    check_no_accumulation(cfg.pop("gradient_accumulation_steps", 1), src)
    mb = cfg.pop("train_micro_batch_size_per_gpu", m)
    if not _same(mb, m):
        raise _conflict("train_micro_batch_size_per_gpu", mb, label, "--batch-size", m)
    tbs = cfg.pop("train_batch_size", None)
    if tbs is not None and world_size is None and not (isinstance(tbs, int) and tbs >= m and tbs % m == 0):
        raise SettingsError(
            f"train_batch_size={js(tbs)} in {label} is not a multiple of --batch-size {m}: drop it"
        )
    if tbs is not None and world_size is not None and not _same(tbs, m * world_size):
        raise SettingsError(
            f"train_batch_size={js(tbs)} in {label} is not --batch-size x world size = {m} x {world_size}: "
            f"drop it; {src.accum_hint}"
        )
    if "elasticity" in cfg:
        raise SettingsError(
            f"elasticity in {label}: it changes batch sizes, which come from --batch-size/--accum-freq"
        )


def read_zero(zero: dict[str, Any], label: str) -> ZeroFacts:
    """The stage and the offload devices of a zero_optimization section (DeepSpeed's defaults: 0, none)."""
    offload: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            raise SettingsError(f"zero_optimization.{key} in {label} must be a JSON object")
        offload[key] = section.get("device", "none")
    return ZeroFacts(zero.get("stage", 0), offload["offload_optimizer"], offload["offload_param"])


def zero_stage(cfg: dict[str, Any], label: str, s: TrainSettings) -> ZeroFacts:
    """--zero-stage over the preset's stage (CLI > preset); what each stage and offload allow."""
    dist = s.dist
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SettingsError(f"zero_optimization in {label} must be a JSON object")
    if dist.zero_stage is not None:
        zero["stage"] = dist.zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise SettingsError(f"zero_optimization.stage={js(stage)} in {label} must be 0, 1, 2 or 3")
    if s.model.torchcompile and stage == 3:
        # DeepSpeed 0.19.8's engine.compile traces the model with ZeRO-3's partitioned parameters (its gather
        # hooks do not run inside the traced forward): dynamo fails on the empty shards ("b must be 2D").
        source = "--zero-stage" if dist.zero_stage is not None else label
        raise SettingsError(
            f"--torchcompile does not work with ZeRO stage 3 (from {source}; DeepSpeed 0.19.8 compiles the "
            "model with its partitioned, empty parameters): use --zero-stage 0, 1 or 2, or drop --torchcompile"
        )
    facts = read_zero(zero, label)
    if facts.offload_optimizer != "none" and stage == 0:
        raise SettingsError(
            f"zero_optimization.offload_optimizer in {label} needs ZeRO stage 1, 2 or 3, not 0"
        )
    if facts.offload_param != "none" and stage != 3:
        raise SettingsError(f"zero_optimization.offload_param in {label} needs ZeRO stage 3, not {stage}")
    return facts


def refuse_fp16_on_zero0(precision: str, stage: Any, what: str, fix: str) -> None:
    """fp16 on ZeRO stage 0 trains wrongly in DeepSpeed 0.19.x (``what`` names the settings, ``fix`` the way
    out, in the words of whoever set them)."""
    if precision == "fp16" and stage == 0:
        raise SettingsError(
            f"{what}: DeepSpeed 0.19.x gives updates ~loss-scale times too small there (upstream PR #8393 "
            f"open); use {fix}"
        )


def precision_sections(cfg: dict[str, Any], label: str, s: TrainSettings, stage: Any) -> None:
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
        refuse_fp16_on_zero0(
            precision, stage, f"--precision fp16 with ZeRO stage 0 ({label}{flagged})",
            "--precision bf16 or --zero-stage 1, 2 or 3",
        )  # fmt: skip
    autocast = cfg.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        raise _conflict("torch_autocast.enabled", True, label, "--precision", precision)


def enabled_precision(cfg: dict[str, Any]) -> str:
    """The precision a user's config enables: "bf16", "fp16" or "fp32"."""

    def enabled(key: str) -> bool:
        return bool(cfg.get(key, {}).get("enabled", False))

    return "bf16" if enabled("bf16") or enabled("bfloat16") else ("fp16" if enabled("fp16") else "fp32")


def clipping(cfg: dict[str, Any], label: str, grad_clip_norm: float | None) -> None:
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


def optimizer_section(cfg: dict[str, Any], label: str, o: OptimSettings, zero: ZeroFacts) -> None:
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


def _coalesce_blocker(cfg: dict[str, Any], zero: ZeroFacts, precision: str, label: str) -> str | None:
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
            f"managed_gradient_accumulation={js(cfg['managed_gradient_accumulation'])} in {label}: "
            "DeepSpeed coalesces only under its managed accumulation"
        )
    data_types = cfg.get("data_types") or {}
    accum = str(data_types.get("grad_accum_dtype", "")).lower() if isinstance(data_types, dict) else ""
    if zero.stage == 1 and precision == "bf16" and zero.offload_optimizer == "none" and accum in _FP32_NAMES:
        return (
            f"data_types.grad_accum_dtype={js(data_types['grad_accum_dtype'])} in {label} with bf16 on ZeRO-1 "
            "makes DeepSpeed wrap the optimizer in BF16_Optimizer, which coalesce_grad_reduction rejects"
        )
    return None


def coalescing(
    cfg: dict[str, Any], mode: str, zero: ZeroFacts, precision: str, src: Source
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


def _merge_step_keys(cfg: dict[str, Any], required: dict[str, Any], src: Source, prefix: str = "") -> None:
    """Deep-merge the step's keys into cfg; a leaf set to another value is an error."""
    for key, value in required.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            _merge_step_keys(cfg[key], value, src, f"{prefix}{key}.")
            continue
        if key in cfg and not _same(cfg[key], value):
            raise _step_conflict(prefix + key, cfg[key], src, value)
        cfg[key] = copy.deepcopy(value)


def step_keys(cfg: dict[str, Any], required: dict[str, Any], src: Source) -> None:
    """The keys the accumulation step relies on: what it requires, and DeepSpeed's defaults of the keys that
    change what a gradient means (a config may repeat them, not change them)."""
    for key, expected in _GRADIENT_MEANING_DEFAULTS.items():
        if key not in required and key in cfg and not _same(cfg[key], expected):
            raise _step_conflict(key, cfg[key], src, expected)
    _merge_step_keys(cfg, required, src)


def engine_batch(cfg: dict[str, Any], m: int, world_size: int) -> None:
    """Every engine step is one micro-batch of m pairs per rank; ds_clip's step runs the k of a step itself."""
    cfg["train_micro_batch_size_per_gpu"] = m
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_batch_size"] = m * world_size


def quiet_engine(cfg: dict[str, Any]) -> None:
    cfg.setdefault("steps_per_print", STEPS_PER_PRINT)  # a preset may ask for DeepSpeed's prints
    cfg.setdefault("wall_clock_breakdown", False)  # a preset may ask for DeepSpeed's timers
    cfg["zero_allow_untested_optimizer"] = True  # torch AdamW under ZeRO is "untested" to DeepSpeed
