"""DeepSpeed JSON: a preset (ds_clip.presets, engine settings only) + TrainSettings -> resolved config.

The preset owns the engine: ZeRO stage and buckets, offload, communication. ds_clip owns everything
that decides what a step computes: batch sizes, accumulation, optimizer, learning rate, precision,
clipping. A preset key that disagrees with a flag is an error naming both; a key that repeats the flag's
value is fine. No deepspeed import here: presets are checked before any process group starts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_clip.presets import OPTIMIZERS, PRESET_DIR, SettingsError, list_presets, load_preset, preset_label

if TYPE_CHECKING:  # duck-typed: ds_clip.config imports this module to check the preset
    from ds_clip.config import TrainSettings

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

_ACCUM_HINT = "ds_clip accumulates itself with exact cached features; use --accum-freq instead"


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


def _step_conflict(
    key: str, value: Any, label: str, expected: Any, via: str = "--accum-freq"
) -> SettingsError:
    return SettingsError(
        f"{key}={_js(value)} in {label} conflicts with ds_clip's accumulation step "
        f"(needs {_js(expected)}; {via}): remove it"
    )


def _merge_step_keys(
    cfg: dict[str, Any], required: dict[str, Any], label: str, prefix: str = "", via: str = "--accum-freq"
) -> None:
    """Deep-merge STEP_ENGINE_KEYS into cfg; a preset leaf with another value is an error."""
    for key, value in required.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            _merge_step_keys(cfg[key], value, label, f"{prefix}{key}.", via)
            continue
        if key in cfg and not _same(cfg[key], value):
            raise _step_conflict(prefix + key, cfg[key], label, value, via)
        cfg[key] = copy.deepcopy(value)


def _coalesce_blocker(
    cfg: dict[str, Any], stage: int, precision: str, offload_opt: str, label: str
) -> str | None:
    """Why DeepSpeed 0.19.8's engine.coalesce_grad_reduction() would refuse this engine, or None.

    It needs a ZeRO 1-3 optimizer (DeepSpeedZeroOptimizer / _Stage3: the classes with the coalescing hooks)
    and managed accumulation. DeepSpeed picks BF16_Optimizer instead on ZeRO-1 with bf16 weights, fp32
    gradient accumulation (data_types.grad_accum_dtype) and no optimizer offload
    (engine._do_optimizer_sanity_check): that wrapper raises NotImplementedError.
    """
    if stage == 0:
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
    if stage == 1 and precision == "bf16" and offload_opt == "none" and accum in _FP32_NAMES:
        return (
            f"data_types.grad_accum_dtype={_js(data_types['grad_accum_dtype'])} in {label} with bf16 on ZeRO-1 "
            "makes DeepSpeed wrap the optimizer in BF16_Optimizer, which coalesce_grad_reduction rejects"
        )
    return None


# DeepSpeed's DtypeEnum spellings of fp32.
_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


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


def _resolve(s: TrainSettings, world_size: int | None) -> tuple[dict[str, Any], str | None]:
    """The resolved JSON, and why --coalesce-grad-reduction auto fell back to off (None otherwise)."""
    o, dist = s.optim, s.dist
    preset = dist.ds_config or default_preset(s, world_size)[0]
    label = preset_label(preset)
    cfg = copy.deepcopy(load_preset(preset))
    m = o.batch_size

    # --- batch: m per rank per pass, one engine step per pass; ds_clip's step does the k passes. ---
    gas = cfg.pop("gradient_accumulation_steps", 1)
    if not _same(gas, 1):
        raise SettingsError(f"gradient_accumulation_steps={_js(gas)} in {label}: {_ACCUM_HINT}")
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
            f"drop it; {_ACCUM_HINT}"
        )
    if "elasticity" in cfg:
        raise SettingsError(
            f"elasticity in {label}: it changes batch sizes, which come from --batch-size/--accum-freq"
        )

    # --- ZeRO stage: --zero-stage overrides the preset (CLI > preset). ---
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SettingsError(f"zero_optimization in {label} must be a JSON object")
    if dist.zero_stage is not None:
        zero["stage"] = dist.zero_stage
    zero.setdefault("stage", 0)
    stage = zero["stage"]
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

    offload: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            raise SettingsError(f"zero_optimization.{key} in {label} must be a JSON object")
        offload[key] = section.get("device", "none")
    offload_opt = offload["offload_optimizer"]
    if offload_opt != "none" and stage == 0:
        raise SettingsError(
            f"zero_optimization.offload_optimizer in {label} needs ZeRO stage 1, 2 or 3, not 0"
        )
    if offload["offload_param"] != "none" and stage != 3:
        raise SettingsError(f"zero_optimization.offload_param in {label} needs ZeRO stage 3, not {stage}")

    # --- precision: exactly the section --precision names is enabled. ---
    if "bfloat16" in cfg:  # DeepSpeed's old spelling; it reads it only when "bf16" is absent
        if "bf16" in cfg:
            raise SettingsError(f"{label} has both bf16 and bfloat16 sections: keep bf16")
        cfg["bf16"] = cfg.pop("bfloat16")
    for key, wanted in (("bf16", dist.precision == "bf16"), ("fp16", dist.precision == "fp16")):
        section = cfg.setdefault(key, {})
        if not isinstance(section, dict):
            raise SettingsError(f"{key} in {label} must be a JSON object")
        if "enabled" in section and not _same(section["enabled"], wanted):
            raise _conflict(f"{key}.enabled", section["enabled"], label, "--precision", dist.precision)
        section["enabled"] = wanted
    if cfg["fp16"]["enabled"]:
        cfg["fp16"].setdefault("loss_scale", 0)  # 0: dynamic loss scaling
        if stage == 0:
            raise SettingsError(
                f"--precision fp16 with ZeRO stage 0 ({label}"
                + (", --zero-stage 0" if dist.zero_stage == 0 else "")
                + "): DeepSpeed 0.19.x gives updates ~loss-scale times too small there (upstream PR #8393 "
                "open); use --precision bf16 or --zero-stage 1, 2 or 3"
            )
    autocast = cfg.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        raise _conflict("torch_autocast.enabled", True, label, "--precision", dist.precision)

    # --- clipping ---
    clip = 0.0 if o.grad_clip_norm is None else float(o.grad_clip_norm)
    if "gradient_clipping" in cfg and not _same(cfg["gradient_clipping"], clip):
        raise _conflict(
            "gradient_clipping", cfg["gradient_clipping"], label, "--grad-clip-norm", o.grad_clip_norm
        )
    cfg["gradient_clipping"] = clip

    # --- optimizer: --opt from the flags (DeepSpeed builds it); the schedule is ds_clip's own. ---
    if "scheduler" in cfg:
        raise SettingsError(
            f"scheduler in {label}: ds_clip runs its own LR schedule (--lr-scheduler, --lr, --warmup); "
            "remove the scheduler section"
        )
    cpu_optimizer = offload_opt in ("cpu", "nvme")
    ds_type, params = optimizer_block(s)
    if o.optimizer == "lamb" and cpu_optimizer:
        raise SettingsError(
            f"--opt lamb with zero_optimization.offload_optimizer in {label}: DeepSpeed 0.19.8 builds FusedLamb, "
            "a CUDA kernel with no CPU version, for the offloaded states: use an optimizer without offload or "
            "--opt adamw or lion"
        )
    preset_opt = cfg.get("optimizer")
    if preset_opt is not None:
        if not isinstance(preset_opt, dict):
            raise SettingsError(f"optimizer in {label} must be a JSON object")
        opt_type = preset_opt.get("type", "AdamW")
        if str(opt_type).lower() != ds_type.lower():
            raise _conflict("optimizer.type", opt_type, label, "--opt", o.optimizer)
        flags = {
            "lr": "--lr", "betas": "--beta1/--beta2", "eps": "--eps", "weight_decay": "--wd", "momentum": "--momentum"
        }  # fmt: skip
        for key, value in (preset_opt.get("params") or {}).items():
            if key in flags and key in params:
                if not _same(value, params[key]):
                    shown = params[key] if key != "betas" else f"{o.beta1}/{o.beta2}"
                    raise _conflict(f"optimizer.params.{key}", value, label, flags[key], shown)
            elif key == "adam_w_mode" and not value:
                raise _conflict(
                    "optimizer.params.adam_w_mode", value, label, "--wd", "(decoupled AdamW decay)"
                )
            elif o.optimizer == "adamw" and key in (
                "torch_adam",
                "foreach",
                "fused",
                "fp32_optimizer_states",
                "adam_w_mode",
            ):
                params[key] = value  # engine choices: which Adam kernel runs the same update
            else:
                raise SettingsError(
                    f"optimizer.params.{key} in {label} is not an engine setting ds_clip passes on: remove it"
                )
    # torch.optim.AdamW runs anywhere (FusedAdam needs a CUDA build); with the optimizer offloaded to the
    # CPU, DeepSpeed's own CPU Adam is much faster, and torch_adam would take precedence over it.
    if not cpu_optimizer and o.optimizer == "adamw":
        params.setdefault("torch_adam", True)
    # torch's AdamW defaults to its per-tensor loop on CPU tensors: six passes over the parameters, moments and
    # gradients per step (2.5 s for ViT-B-32's 151M parameters on one core, more than its forward and backward
    # at m=4). Its fused kernel (CPU and CUDA) runs the same AdamW update in one pass per tensor, 3x faster here;
    # DeepSpeed hands "fused" to torch.optim.AdamW with the other params. A preset's "foreach" choice stands.
    if params.get("torch_adam") and "foreach" not in params:
        params.setdefault("fused", True)
    cfg["optimizer"] = {"type": ds_type, "params": params}

    # --- one gradient reduction per step (--coalesce-grad-reduction): decided here, with the preset. ---
    mode = dist.coalesce_grad_reduction
    blocker = None if mode == "off" else _coalesce_blocker(cfg, stage, dist.precision, offload_opt, label)
    if mode == "on" and blocker is not None:
        raise SettingsError(f"--coalesce-grad-reduction on: {blocker}; use off or auto")
    required = dict(STEP_ENGINE_KEYS)
    if mode != "off" and blocker is None:
        required.update(COALESCE_ENGINE_KEYS)

    # --- keys the accumulation step relies on ---
    for key, expected in _GRADIENT_MEANING_DEFAULTS.items():
        if key not in required and key in cfg and not _same(cfg[key], expected):
            raise _step_conflict(key, cfg[key], label, expected)
    _merge_step_keys(cfg, required, label)

    if world_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = m
        cfg["gradient_accumulation_steps"] = 1
        cfg["train_batch_size"] = m * world_size
    cfg.setdefault("steps_per_print", STEPS_PER_PRINT)  # a preset may ask for DeepSpeed's prints
    cfg.setdefault("wall_clock_breakdown", False)  # a preset may ask for DeepSpeed's timers
    cfg["zero_allow_untested_optimizer"] = True  # torch AdamW under ZeRO is "untested" to DeepSpeed
    return cfg, (blocker if mode == "auto" else None)


def optimizer_block(s: TrainSettings) -> tuple[str, dict[str, Any]]:
    """--opt -> DeepSpeed's optimizer "type" and the params it takes from the flags (each optimizer only
    the hyper-parameters its class has; per-group lr and weight_decay come with the parameter groups)."""
    o = s.optim
    params: dict[str, Any] = {"lr": o.lr, "weight_decay": o.wd}
    if o.optimizer in ("adamw", "lamb", "lion"):
        params["betas"] = [o.beta1, o.beta2]
    if o.optimizer in ("adamw", "lamb"):
        params["eps"] = o.eps
    if o.optimizer == "sgd":
        params["momentum"] = 0.0 if o.momentum is None else o.momentum
    return OPTIMIZERS[o.optimizer], params


def optimizer_blocker(s: TrainSettings, accelerator: str) -> str | None:
    """Why DeepSpeed 0.19.8 cannot build --opt on this accelerator ("cuda", "cpu", ...), else None.

    Measured on the CPU accelerator: "Lamb" builds FusedLamb and "Lion" FusedLion, CUDA kernels the CPU
    accelerator does not implement ("This op had not been implemented on CPU backend"); with the optimizer
    offloaded "Lion" builds DeepSpeedCPULion (a C++ op, compiled on first use). AdamW and SGD run anywhere.
    """
    o = s.optim
    if accelerator == "cuda":
        return None
    offloaded = False
    try:
        zero = _resolve(s, world_size=None)[0]["zero_optimization"]
        offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    except SettingsError:
        return None  # the preset's own error is raised by check_preset
    if o.optimizer == "lamb":
        return (
            f"--opt lamb: DeepSpeed 0.19.8 builds FusedLamb, a CUDA kernel, and this machine's accelerator is "
            f"{accelerator}: use --opt adamw, lion (with an offload preset) or sgd, or a CUDA machine"
        )
    if o.optimizer == "lion" and not offloaded:
        return (
            f"--opt lion: on the {accelerator} accelerator DeepSpeed 0.19.8 has only its CPU Lion, used when the "
            "optimizer is offloaded: add --ds-config zero2_offload_fp32 (or another *_offload_* preset)"
        )
    return None


def bn_sync_blocker(s: TrainSettings, accelerator: str) -> str | None:
    """Why --use-bn-sync cannot run here, else None: torch's SyncBatchNorm forward refuses CPU tensors whenever
    a process group exists, one rank included (torch.nn.SyncBatchNorm.forward: "expected input tensor to be on
    GPU"; measured with torch 2.14)."""
    if not s.model.use_bn_sync or accelerator != "cpu":
        return None
    return (
        "--use-bn-sync on the CPU: torch's SyncBatchNorm runs on GPUs only (its forward refuses CPU tensors); "
        "drop it (each rank then normalises with its own micro-batch) or run on GPUs"
    )


def check_preset(s: TrainSettings) -> None:
    """Raise SettingsError if the preset is missing, unreadable or disagrees with the flags.

    Called from config.validate before the world size is known; train_batch_size is checked later.
    """
    _resolve(s, world_size=None)


def coalesce_fallback(s: TrainSettings, world_size: int | None = None) -> str | None:
    """Why ``--coalesce-grad-reduction auto`` runs without coalescing here (for one log line), else None."""
    return _resolve(s, world_size=world_size)[1]


def resolve_ds_config(s: TrainSettings, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for `deepspeed.initialize(config=...)`: preset engine settings + flags.

    train_batch_size = m * W and gradient_accumulation_steps = 1: every engine step is one micro-batch;
    ds_clip's step runs the k micro-batches of an optimizer step itself.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _resolve(s, world_size)[0]


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
    ``coalesce=True`` where DeepSpeed cannot coalesce.
    """
    label, via = "your DeepSpeed config", "ds_clip.cached_step"
    cfg = copy.deepcopy(config)
    gas = cfg.get("gradient_accumulation_steps", 1)
    if not _same(gas, 1):
        raise SettingsError(
            f"gradient_accumulation_steps={_js(gas)} in {label}: cached_step runs the k micro-batches of a step "
            "itself (exactly); set it to 1 and pass them to cached_step"
        )
    cfg["gradient_accumulation_steps"] = 1
    if "train_batch_size" in cfg and "train_micro_batch_size_per_gpu" in cfg:
        raise SettingsError(
            f"train_batch_size={_js(cfg['train_batch_size'])} in {label}: with cached_step the engine's batch "
            "is one micro-batch per rank; keep train_micro_batch_size_per_gpu (m) alone, DeepSpeed derives "
            "train_batch_size = m x world size"
        )
    for key in ("zero_optimization", "bf16", "bfloat16", "fp16"):
        if not isinstance(cfg.get(key, {}), dict):
            raise SettingsError(f"{key} in {label} must be a JSON object")
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none")

    def enabled(key: str) -> bool:
        return bool(cfg.get(key, {}).get("enabled", False))

    precision = "bf16" if enabled("bf16") or enabled("bfloat16") else ("fp16" if enabled("fp16") else "fp32")
    if precision == "fp16" and stage == 0:
        raise SettingsError(
            f"fp16 with ZeRO stage 0 in {label}: DeepSpeed 0.19.x gives updates ~loss-scale times too small "
            "there (upstream PR #8393 open); use bf16 or ZeRO stage 1, 2 or 3"
        )
    required = dict(STEP_ENGINE_KEYS)
    if coalesce:
        blocker = _coalesce_blocker(cfg, stage, precision, offload_opt, label)
        if blocker is not None:
            raise SettingsError(f"coalesce=True: {blocker}")
        required.update(COALESCE_ENGINE_KEYS)
    for key, expected in _GRADIENT_MEANING_DEFAULTS.items():
        if key not in required and key in cfg and not _same(cfg[key], expected):
            raise _step_conflict(key, cfg[key], label, expected, via)
    _merge_step_keys(cfg, required, label, via=via)
    return cfg


def write_run_files(run_dir: Path, settings: dict[str, Any], ds_json: dict[str, Any]) -> None:
    """Write settings.json (`config.settings_to_dict`) and ds_config.json (indented) into the run folder.
    Rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    (run_dir / "ds_config.json").write_text(json.dumps(ds_json, indent=2) + "\n")


__all__ = [
    "PRESET_DIR",  # re-exported from ds_clip.presets, where the preset files are found
    "COALESCE_ENGINE_KEYS",
    "STEP_ENGINE_KEYS",
    "check_preset",
    "coalesce_fallback",
    "optimizer_block",
    "optimizer_blocker",
    "bn_sync_blocker",
    "default_preset",
    "list_presets",
    "load_preset",
    "preset_label",
    "resolve_ds_config",
    "step_engine_config",
    "write_run_files",
]
