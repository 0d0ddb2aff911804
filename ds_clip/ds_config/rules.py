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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ds_clip.ds_config.presets import (
    ONE_LR_SCHEDULERS,
    OPTIMIZERS,
    SettingsError,
    is_auto,
    optimizer_of,
    preset_label,
    scheduler_block,
)


class OptimValues(Protocol):
    """What the rules read of the optimizer flags (``ds_clip.config.OptimValues`` is one): the batch triple, the
    optimizer and its hyper-parameters, warmup, clipping and the per-tower LRs."""

    batch_size: int
    accum_freq: int | None
    global_batch_size: int | None
    optimizer: str
    lr: float
    wd: float
    beta1: float
    beta2: float
    eps: float
    momentum: float | None
    warmup: int
    grad_clip_norm: float | None
    visual_lr: float | None
    text_lr: float | None
    visual_ld: float
    text_ld: float


@dataclass(frozen=True)
class DeepSpeedRequest:
    """What a run asks of its DeepSpeed config, and nothing more of its settings: the optimizer flags, the
    distributed flags, the two model flags a preset can refuse, and where each value came from
    (``ds_clip.config.TrainSettings.deepspeed_request`` builds it)."""

    optim: OptimValues
    """The optimizer section (--batch-size, --accum-freq, --opt, --lr, ...)."""
    precision: str = "fp32"
    """--precision."""
    zero_stage: int | None = None
    """--zero-stage; None: the preset's."""
    coalesce_grad_reduction: str = "auto"
    """--coalesce-grad-reduction."""
    ds_config: str | None = None
    """--ds-config (a preset name or a path); None: the default preset."""
    use_bn_sync: bool = False
    """--use-bn-sync."""
    torchcompile: bool = False
    """--torchcompile."""
    sources: Mapping[str, str] | None = None
    """Where each field's value came from (``TrainSettings.sources``); None: settings not parsed from a command
    line, every field counts as chosen."""

    def chosen(self, name: str) -> bool:
        """Did the user choose field ``name`` (a flag or a recipe)? As ``TrainSettings.chosen``."""
        return self.sources is None or self.sources.get(name) in ("flag", "recipe")


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


def same_value(a: Any, b: Any) -> bool:
    """Equal as a DeepSpeed JSON means it (2e8 == 200000000, [0.9, 0.98] == (0.9, 0.98)); dicts key by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return _same(a, b)


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


@dataclass
class Settle:
    """Writes ds_clip's resolved settings into a JSON's keys, in one way for every rule: an absent or "auto" key
    gets the setting (recorded in ``filled``); a key the file sets to the same value stays; a key the file sets
    to another value is either a flag the user passed over the file's value (parsed settings: the flag wins,
    one line in ``notes``) or, for settings not parsed from a command line (``TrainSettings.of``, which cannot
    tell a choice from a default), a conflict naming both."""

    label: str
    s: DeepSpeedRequest
    """The run's request (``chosen``, ``sources``)."""
    notes: list[str] = field(default_factory=list)
    filled: dict[str, str] = field(default_factory=dict)
    """Key path -> the flag whose value filled its "auto"."""

    def __call__(
        self, section: dict[str, Any], key: str, value: Any, path: str, flag: str, shown: Any
    ) -> None:
        """Set ``section[key]`` (``path`` in messages) to ``value``, the value of ``flag`` (shown as ``shown``)."""
        if key in section and is_auto(section[key]):
            self.filled[path] = flag
        elif key in section and not _same(section[key], value):
            if self.s.sources is None:
                raise _conflict(path, section[key], self.label, flag, shown)
            self.notes.append(f"{flag} {shown} over {path}={js(section[key])} in {self.label}")
        section[key] = value


# ------------------------------------------------------------------------------------------------ rules


def check_no_accumulation(value: Any, src: Source) -> None:
    """DeepSpeed's own accumulation stays off: ds_clip's step runs the k micro-batches of a step itself."""
    if not _same(value, 1):
        raise SettingsError(f"gradient_accumulation_steps={js(value)} in {src.label}: {src.accum_hint}")


def batch_keys(cfg: dict[str, Any], src: Source, s: DeepSpeedRequest, world_size: int | None) -> list[str]:
    """Take the batch keys out of a JSON (they are written back for the geometry at the end, ``engine_batch``)
    and say what they became: parsed settings already hold the file's triple (config.ds_json; the geometry
    checks it against the world size at start), so its k runs as exact cached accumulation. Settings not parsed
    from a command line may only repeat their own m (and k = 1), as before."""
    label = src.label
    gas = cfg.pop("gradient_accumulation_steps", None)
    mb = cfg.pop("train_micro_batch_size_per_gpu", None)
    tbs = cfg.pop("train_batch_size", None)
    if "elasticity" in cfg:
        raise SettingsError(
            f"elasticity in {label}: it changes batch sizes, which come from --batch-size/--accum-freq"
        )
    o = s.optim
    if s.sources is None:
        m = o.batch_size
        check_no_accumulation(1 if gas is None or is_auto(gas) else gas, src)
        if mb is not None and not is_auto(mb) and not _same(mb, m):
            raise _conflict("train_micro_batch_size_per_gpu", mb, label, "--batch-size", m)
        if tbs is not None and not is_auto(tbs):
            if world_size is None and not (isinstance(tbs, int) and tbs >= m and tbs % m == 0):
                raise SettingsError(
                    f"train_batch_size={js(tbs)} in {label} is not a multiple of --batch-size {m}: drop it"
                )
            if world_size is not None and not _same(tbs, m * world_size):
                raise SettingsError(
                    f"train_batch_size={js(tbs)} in {label} is not --batch-size x world size = {m} x {world_size}: "
                    f"drop it; {src.accum_hint}"
                )
        return []
    notes = []
    if gas is not None and not is_auto(gas) and s.sources.get("accum_freq") == "ds_json" and gas != 1:
        notes.append(
            f"gradient_accumulation_steps={js(gas)} in {label} runs as --accum-freq {gas}: exact cached "
            "accumulation (one loss over all k micro-batches); the engine runs with gradient_accumulation_steps=1"
        )
    for key, value, fld in (("train_micro_batch_size_per_gpu", mb, "batch_size"),
                            ("gradient_accumulation_steps", gas, "accum_freq"),
                            ("train_batch_size", tbs, "global_batch_size")):  # fmt: skip
        given = getattr(o, fld)
        if value is not None and not is_auto(value) and s.chosen(fld) and not _same(value, given):
            notes.append(f"{_FLAG_OF[fld]} {given} over {key}={js(value)} in {label}")
    return notes


_FLAG_OF = {
    "batch_size": "--batch-size",
    "accum_freq": "--accum-freq",
    "global_batch_size": "--global-batch-size",
}


# Sections for what ds_clip does not do (each would change the model or the data it trains, or serves inference
# only): refused by key when enabled (a section present with "enabled": false, or an empty one, is fine).
_NOT_DONE = {
    "tensor_parallel": "tensor parallelism (ds_clip is data parallel: every rank holds the whole model)",
    "pipeline": "pipeline parallelism (ds_clip is data parallel)",
    "sequence_parallel_size": "sequence parallelism (ds_clip is data parallel)",
    "hybrid_engine": "DeepSpeed-Chat's hybrid inference engine",
    "inference": "an inference-only section",
    "replace_with_kernel_inject": "inference kernel injection",
    "compression_training": "compression training (quantization or pruning of the model)",
    "curriculum_learning": "curriculum learning (it changes the data per step)",
    "data_efficiency": "data efficiency (it changes the data per step)",
    "progressive_layer_drop": "progressive layer drop (it changes the model per step)",
    "sparse_attention": "sparse attention kernels (it changes the model)",
    "autotuning": "autotuning (it launches experiments, not a training run)",
    "moe": "mixture of experts",
}


def _enabled(value: Any) -> bool:
    if isinstance(value, dict):
        return bool(value) and value.get("enabled", True) is not False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 1
    return value is not None


def refuse_not_done(cfg: dict[str, Any], label: str) -> list[str]:
    """Keys for things ds_clip does not do, by key (logging and legacy keys pass: steps_per_print,
    wall_clock_breakdown, zero_allow_untested_optimizer, flops_profiler, ...). A disabled apex ``amp`` section
    (DeepSpeed 0.19.8 removed apex, and refuses the key even when off) is dropped, one note saying so."""
    notes = []
    amp = cfg.get("amp")
    if isinstance(amp, dict) and amp.get("enabled", False) is False:
        del cfg["amp"]
        notes.append(f"amp (NVIDIA apex, removed from DeepSpeed 0.19.8) is disabled in {label}: dropped")
    elif amp is not None:
        raise SettingsError(
            f"amp.enabled=true in {label}: NVIDIA apex's amp was removed from DeepSpeed 0.19.8 (and ran on CUDA "
            "only); use a bf16 or fp16 section, or torch_autocast"
        )
    for key, what in _NOT_DONE.items():
        if key in cfg and _enabled(cfg[key]):
            raise SettingsError(f"{key} in {label}: ds_clip does not run {what}; remove it")
    zero = cfg.get("zero_optimization") or {}
    if isinstance(zero, dict) and zero.get("zenflow") is not None:
        # DeepSpeed 0.19.8's ZenFlow (engine.configure_zenflow) sets the engine's gradient_accumulation_steps to
        # its update_interval and applies the less important gradients' updates later, on the CPU: a step
        # would not apply the one averaged gradient of its N pairs.
        raise SettingsError(
            f"zero_optimization.zenflow in {label}: ZenFlow updates the most important gradient columns each step "
            "and applies the rest later, asynchronously on the CPU (every update_interval steps), so a step would "
            "not apply the exact averaged gradient of its batch that ds_clip trains with; remove it "
            "(zero_optimization.offload_optimizer without zenflow trains)"
        )
    hpz = zero.get("zero_hpz_partition_size", 1) if isinstance(zero, dict) else 1
    if isinstance(hpz, int) and hpz > 1:
        raise SettingsError(
            f"zero_optimization.zero_hpz_partition_size={hpz} in {label}: ZeRO++'s secondary weight partition is "
            "not run by ds_clip (its cached step re-runs each forward, and hpZ's copies are untested there); remove it"
        )
    return notes


def hardware_blocker(cfg: dict[str, Any], label: str, accelerator: str) -> str | None:
    """Why this machine's accelerator cannot serve a key of the JSON (NVMe offload, CUDA-only ops), else None."""
    if accelerator == "cuda":
        return None
    zero = cfg.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if isinstance(section, dict) and section.get("device") == "nvme":
            return (
                f'zero_optimization.{key}.device="nvme" in {label}: NVMe offload needs DeepSpeed\'s async I/O op on '
                f'a CUDA machine with an NVMe drive, and this machine\'s accelerator is {accelerator}: use "cpu"'
            )
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if zero.get(key) is True:
            return (
                f"zero_optimization.{key}=true in {label}: ZeRO++'s quantization runs CUDA kernels, and this "
                f"machine's accelerator is {accelerator}: remove it"
            )
    return None


def read_zero(zero: dict[str, Any], label: str) -> ZeroFacts:
    """The stage and the offload devices of a zero_optimization section (DeepSpeed's defaults: 0, none)."""
    offload: dict[str, str] = {}
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if not isinstance(section, dict):
            raise SettingsError(f"zero_optimization.{key} in {label} must be a JSON object")
        offload[key] = section.get("device", "none")
    return ZeroFacts(zero.get("stage", 0), offload["offload_optimizer"], offload["offload_param"])


def zero_stage(cfg: dict[str, Any], label: str, s: DeepSpeedRequest) -> ZeroFacts:
    """--zero-stage over the preset's stage (CLI > preset); what each stage and offload allow."""
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SettingsError(f"zero_optimization in {label} must be a JSON object")
    if zero.get("cpu_offload") is True and "offload_optimizer" not in zero:
        # DeepSpeed's legacy spelling of offload_optimizer.device "cpu" (still accepted by 0.19.8's config).
        del zero["cpu_offload"]
        zero["offload_optimizer"] = {"device": "cpu"}
    if s.zero_stage is not None:
        zero["stage"] = s.zero_stage
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise SettingsError(f"zero_optimization.stage={js(stage)} in {label} must be 0, 1, 2 or 3")
    if s.torchcompile and stage == 3:
        # DeepSpeed 0.19.8's engine.compile traces the model with ZeRO-3's partitioned parameters (its gather
        # hooks do not run inside the traced forward): dynamo fails on the empty shards ("b must be 2D").
        source = "--zero-stage" if s.zero_stage is not None else label
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


def precision_sections(cfg: dict[str, Any], settle: Settle, stage: Any) -> None:
    """Exactly the section --precision names is enabled ("auto" filled; the file's own enabled section has
    become --precision when the flag was left out, config.ds_json). torch_autocast runs as the --precision it
    maps to (its dtype's bf16 or fp16: DeepSpeed's low-precision weights with an fp32 master copy)."""
    label, s = settle.label, settle.s
    precision = s.precision
    if "bfloat16" in cfg:  # DeepSpeed's old spelling; it reads it only when "bf16" is absent
        if "bf16" in cfg:
            raise SettingsError(f"{label} has both bf16 and bfloat16 sections: keep bf16")
        cfg["bf16"] = cfg.pop("bfloat16")
    autocast = cfg.get("torch_autocast")
    bf16_too = isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled") is True
    if bf16_too and precision == "bf16" and isinstance(autocast, dict) and autocast.get("enabled") is True:
        # The file enables bf16 and torch_autocast together (DeepSpeedExamples' bf16_master_weight configs):
        # DeepSpeed runs its bf16 engine under torch.autocast, as written (config.ds_json.precision_of).
        pass
    elif isinstance(autocast, dict) and autocast.get("enabled") is True:
        if s.sources is None:
            raise _conflict("torch_autocast.enabled", True, label, "--precision", precision)
        settle.notes.append(
            f"torch_autocast in {label} runs as --precision {precision}: DeepSpeed {precision} (low-precision "
            "weights, fp32 master copy in the optimizer), ds_clip's mapping of open_clip's amp names"
        )
        autocast["enabled"] = False
    for key, wanted in (("bf16", precision == "bf16"), ("fp16", precision == "fp16")):
        section = cfg.setdefault(key, {})
        if not isinstance(section, dict):
            raise SettingsError(f"{key} in {label} must be a JSON object")
        settle(section, "enabled", wanted, f"{key}.enabled", "--precision", precision)
    if cfg["fp16"]["enabled"]:
        cfg["fp16"].setdefault("loss_scale", 0)  # 0: dynamic loss scaling
        flagged = ", --zero-stage 0" if s.zero_stage == 0 else ""
        refuse_fp16_on_zero0(
            precision, stage, f"--precision fp16 with ZeRO stage 0 ({label}{flagged})",
            "--precision bf16 or --zero-stage 1, 2 or 3",
        )  # fmt: skip


def enabled_precision(cfg: dict[str, Any]) -> str:
    """The precision a user's config enables: "bf16", "fp16" or "fp32"."""

    def enabled(key: str) -> bool:
        return bool(cfg.get(key, {}).get("enabled", False))

    return "bf16" if enabled("bf16") or enabled("bfloat16") else ("fp16" if enabled("fp16") else "fp32")


def clipping(cfg: dict[str, Any], settle: Settle, grad_clip_norm: float | None) -> None:
    clip = 0.0 if grad_clip_norm is None else float(grad_clip_norm)
    settle(cfg, "gradient_clipping", clip, "gradient_clipping", "--grad-clip-norm", grad_clip_norm)


def optimizer_block(o: OptimValues) -> tuple[str, dict[str, Any]]:
    """--opt -> DeepSpeed's optimizer "type" and the params it takes from the flags (each optimizer only
    the hyper-parameters its class has; per-group lr and weight_decay come with the parameter groups)."""
    params: dict[str, Any] = {"lr": o.lr, "weight_decay": o.wd}
    if o.optimizer in ("adamw", "adam", "lamb", "lion", "muon"):
        params["betas"] = [o.beta1, o.beta2]
    if o.optimizer in ("adamw", "adam", "lamb", "muon"):
        params["eps"] = o.eps
    if o.optimizer == "adam":
        params["adam_w_mode"] = False  # L2: weight decay added to the gradient (DeepSpeed's Adam)
    if o.optimizer == "sgd":
        params["momentum"] = 0.0 if o.momentum is None else o.momentum
    if o.optimizer == "muon" and o.momentum is not None:
        params["momentum"] = o.momentum
    return OPTIMIZERS[o.optimizer], params


# A JSON's optimizer params that are a flag's value, by key: the flag and the value it holds.
_OPTIMIZER_FLAGS = {
    "lr": "--lr", "betas": "--beta1/--beta2", "eps": "--eps", "weight_decay": "--wd", "momentum": "--momentum"
}  # fmt: skip
# Each optimizer's engine choices a JSON may add (which kernel runs the update, its own extra terms); they pass
# on to the class DeepSpeed builds as written.
_ENGINE_CHOICES = {
    "adamw": (
        "torch_adam",
        "foreach",
        "fused",
        "fp32_optimizer_states",
        "adam_w_mode",
        "bias_correction",
        "amsgrad",
    ),
    "lamb": ("bias_correction", "max_coeff", "min_coeff", "eps_inside_sqrt", "amsgrad"),
    "lion": (),
    "muon": ("muon_lr", "adam_lr", "ns_method", "torch_adam", "adam_w_mode"),
    "sgd": ("nesterov", "dampening"),
}
_ENGINE_CHOICES["adam"] = _ENGINE_CHOICES["adamw"]


def _json_optimizer_params(block: Any, settle: Settle, o: OptimValues, params: dict[str, Any]) -> str:
    """A JSON's optimizer block: its hyper-parameters are the flags' values (``settle``), its engine choices pass on
    into ``params``; returns the "type" as the file spells it."""
    label = settle.label
    if not isinstance(block, dict):
        raise SettingsError(f"optimizer in {label} must be a JSON object")
    kind = block.get("type", "AdamW")
    given = block.get("params") or {}
    if not isinstance(given, dict):
        raise SettingsError(f"optimizer.params in {label} must be a JSON object")
    if optimizer_of(kind, given, label) != o.optimizer:
        raise _conflict("optimizer.type", kind, label, "--opt", o.optimizer)
    merged = dict(given)
    sources = settle.s.sources or {}
    lr = merged.get("lr")
    if sources.get("lr") == "ds_json" and lr is not None and not is_auto(lr) and not _same(lr, o.lr):
        # The file's scheduler peak became the lr (config.ds_json): DeepSpeed's WarmupLR sets the lr itself.
        settle.notes.append(
            f"scheduler.params.warmup_max_lr={js(o.lr)} in {label} is the peak lr (DeepSpeed's scheduler sets the "
            f"lr itself): optimizer.params.lr={js(lr)} is not used"
        )
        merged["lr"] = o.lr
    rates = {k: merged[k] for k in ("muon_lr", "adam_lr") if k in merged}
    if o.optimizer == "muon" and rates and sources.get("lr") in ("flag", "recipe"):
        # --lr passed: both halves train at it (the groups carry it), so the file's two rates go.
        for key in rates:
            del merged[key]
        shown = " and ".join(f"optimizer.params.{k}={js(v)}" for k, v in rates.items())
        settle.notes.append(f"--lr {o.lr} over {shown} in {label}: Muon and its AdamW both train at --lr")
    for key in list(params):
        shown = params[key] if key != "betas" else f"{o.beta1}/{o.beta2}"
        if key in _OPTIMIZER_FLAGS:
            settle(merged, key, params[key], f"optimizer.params.{key}", _OPTIMIZER_FLAGS[key], shown)
    for key, value in merged.items():
        if key in _OPTIMIZER_FLAGS:
            params[key] = value
        elif key in _ENGINE_CHOICES[o.optimizer]:
            params[key] = value
        else:
            raise SettingsError(
                f"optimizer.params.{key} in {label} is not a setting of DeepSpeed's {kind} that ds_clip passes on: "
                "remove it"
            )
    return str(kind)


def optimizer_section(cfg: dict[str, Any], settle: Settle, o: OptimValues, zero: ZeroFacts) -> None:
    """The optimizer DeepSpeed builds from the JSON: --opt and its flags, or the file's block with its engine
    choices (the hyper-parameters are the settings', which the file's values became unless a flag was passed)."""
    label = settle.label
    ds_type, params = optimizer_block(o)
    if o.optimizer == "lamb" and zero.cpu_optimizer:
        block = cfg.get("optimizer") if (settle.s.sources or {}).get("optimizer") == "ds_json" else None
        asked = f"optimizer.type={js(block.get('type'))}" if isinstance(block, dict) else "--opt lamb"
        raise SettingsError(
            f"{asked} with zero_optimization.offload_optimizer in {label}: DeepSpeed 0.19.8 builds FusedLamb, "
            "a CUDA kernel with no CPU version, for the offloaded states: use an optimizer without offload or "
            "--opt adamw or lion"
        )
    if cfg.get("optimizer") is not None:
        ds_type = _json_optimizer_params(cfg["optimizer"], settle, o, params)
    if o.optimizer in ("adamw", "adam"):
        _adam_kernel(params, zero, label)
    cfg["optimizer"] = {"type": ds_type, "params": params}


def muon_reduce_scatter(
    cfg: dict[str, Any], settle: Settle, o: OptimValues, zero: ZeroFacts, shipped: bool
) -> None:
    """Muon on ZeRO-3 needs zero_optimization.reduce_scatter false: DeepSpeed 0.19.8's stage3.py raises "Muon and
    reduce scatter cannot be used together" on every rank, and the key defaults to true. Left to its default
    (or set by a shipped preset), it is turned off with one note; a user's file that asks for true is refused
    naming the key, before any rank starts."""
    if o.optimizer != "muon" or zero.stage != 3:
        return
    section = cfg["zero_optimization"]
    value = section.get("reduce_scatter")
    if value is not None and not is_auto(value) and value is not False and not shipped:
        raise SettingsError(
            f"zero_optimization.reduce_scatter={js(value)} in {settle.label}: DeepSpeed's Muon on ZeRO stage 3 "
            "needs it false (Muon orthogonalises whole matrices, and reduce-scatter leaves each rank a slice): "
            "set it to false or remove it"
        )
    if value is not False:
        section["reduce_scatter"] = False
        settle.notes.append(
            f"zero_optimization.reduce_scatter=false for Muon on ZeRO stage 3 ({settle.label}"
            f"{'' if value is None else ' set it to ' + js(value)}; DeepSpeed's default true raises 'Muon and "
            "reduce scatter cannot be used together'): the gradients are all-reduced instead"
        )


def _adam_kernel(params: dict[str, Any], zero: ZeroFacts, label: str) -> None:
    """Which kernel runs DeepSpeed's Adam/AdamW update."""
    # torch.optim.AdamW runs anywhere (FusedAdam needs a CUDA build); with the optimizer offloaded to the
    # CPU, DeepSpeed's own CPU Adam is much faster, and torch_adam would take precedence over it.
    if not zero.cpu_optimizer:
        params.setdefault("torch_adam", True)
    if params.get("torch_adam"):
        # torch's Adam always corrects its moments' bias and has no such argument.
        if params.pop("bias_correction", True) is not True:
            raise SettingsError(
                f"optimizer.params.bias_correction=false in {label} with torch_adam: torch's Adam always corrects "
                "the bias; remove one of them"
            )
    # torch's AdamW defaults to its per-tensor loop on CPU tensors: six passes over the parameters, moments and
    # gradients per step (2.5 s for ViT-B-32's 151M parameters on one core, more than its forward and backward
    # at m=4). Its fused kernel (CPU and CUDA) runs the same AdamW update in one pass per tensor, 3x faster here;
    # DeepSpeed hands "fused" to torch.optim.AdamW with the other params. A JSON's "foreach" choice stands.
    if params.get("torch_adam") and "foreach" not in params:
        params.setdefault("fused", True)


def scheduler_section(cfg: dict[str, Any], settle: Settle, o: OptimValues) -> str | None:
    """A JSON's scheduler block runs as written (DeepSpeed builds it; it steps once per optimizer step), its
    "auto" params filled from --lr and --warmup, total_num_steps ("auto") at start from the run's length
    (``fill_start_keys``). None: no block, ds_clip's --lr-scheduler runs. Returns the block's type."""
    label = settle.label
    found = scheduler_block(cfg, label)
    if found is None:
        return None
    kind, params = found
    if kind in ("WarmupLR", "WarmupDecayLR"):
        if is_auto(params.get("warmup_min_lr")):
            params["warmup_min_lr"] = 0.0  # the trainer's warmup starts from 0, as Hugging Face fills it
            settle.filled["scheduler.params.warmup_min_lr"] = "0 (warmup from zero)"
        settle(params, "warmup_max_lr", o.lr, "scheduler.params.warmup_max_lr", "--lr", o.lr)
    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        # DeepSpeed 0.19.8's warmup schedulers refuse warmup_num_steps < 1 (WarmupLR warms up over max(2, n)):
        # --warmup 0 (ds_clip's default) fills an absent or "auto" key with 1.
        steps = o.warmup
        if steps < 1 and (is_auto(params.get("warmup_num_steps")) or "warmup_num_steps" not in params):
            steps = 1
        settle(params, "warmup_num_steps", steps, "scheduler.params.warmup_num_steps", "--warmup", steps)
        if not (isinstance(params["warmup_num_steps"], int) and params["warmup_num_steps"] >= 1):
            raise SettingsError(
                f"scheduler.params.warmup_num_steps={js(params['warmup_num_steps'])} in {label}: DeepSpeed's "
                f"{kind} needs a whole number >= 1"
            )
    for key, value in params.items():
        if is_auto(value) and key != "total_num_steps":
            raise SettingsError(
                f'scheduler.params.{key}="auto" in {label}: ds_clip has no setting to fill it with; write a value'
            )
    rates = [k for k in ("muon_lr", "adam_lr") if k in (cfg.get("optimizer") or {}).get("params", {})]
    if kind in ONE_LR_SCHEDULERS and o.optimizer == "muon" and rates:
        raise SettingsError(
            f"scheduler.type={js(kind)} in {label} sets one LR for every parameter group, which would overwrite "
            f"optimizer.params.{' and '.join(rates)} (DeepSpeed's Muon and AdamW halves): use WarmupCosineLR (it "
            "scales each group's own LR) or drop those keys"
        )
    per_group = o.visual_lr is not None or o.text_lr is not None or o.visual_ld != 1.0 or o.text_ld != 1.0
    if kind in ONE_LR_SCHEDULERS and per_group:
        raise SettingsError(
            f"scheduler.type={js(kind)} in {label} sets one LR for every parameter group, which would overwrite "
            "the per-tower LRs (--visual-lr/--text-lr/--visual-ld/--text-ld): use WarmupCosineLR (it scales each "
            "group's own LR) or drop those flags"
        )
    return str(kind)


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


# Keys whose "auto" Hugging Face fills from the model's hidden size h (its deepspeed.py): h*h, 0.9*h*h, 10*h.
MODEL_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def start_auto_keys(cfg: dict[str, Any], label: str) -> dict[str, str]:
    """The "auto" keys left for the start (``fill_start_keys``: the model's hidden size, the run's length) by
    path -> what fills them; every other "auto" still in ``cfg`` is refused, naming its key."""
    left: dict[str, str] = {}
    zero = cfg.get("zero_optimization") or {}
    for key in MODEL_SIZE_KEYS:
        if is_auto(zero.get(key)):
            left[f"zero_optimization.{key}"] = "the model's hidden size at start"
    if is_auto(zero.get("stage3_gather_16bit_weights_on_model_save")):
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # ds_clip saves DeepSpeed checkpoints
    scheduler = cfg.get("scheduler") or {}
    params = scheduler.get("params") or {}
    if scheduler.get("type") in ("WarmupDecayLR", "WarmupCosineLR") and (
        "total_num_steps" not in params or is_auto(params["total_num_steps"])
    ):
        left["scheduler.params.total_num_steps"] = "the run's optimizer steps at start"

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif is_auto(node) and path not in left:
            raise SettingsError(
                f'{path}="auto" in {label}: ds_clip has no setting to fill it with; write a value'
            )

    walk(cfg, "")
    return left


def fill_start_keys(cfg: dict[str, Any], *, hidden_size: int, total_steps: int, buckets: bool = True) -> None:
    """Fill the keys ``start_auto_keys`` left: ZeRO buckets from the model's hidden size (``buckets``), a
    scheduler's total_num_steps from the run's optimizer steps."""
    zero = cfg.get("zero_optimization") or {}
    for key, size in MODEL_SIZE_KEYS.items():
        if buckets and is_auto(zero.get(key)):
            zero[key] = size(hidden_size)
    scheduler = cfg.get("scheduler") or {}
    params = scheduler.get("params")
    if params is not None and scheduler.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
        if "total_num_steps" not in params or is_auto(params["total_num_steps"]):
            params["total_num_steps"] = total_steps


def engine_batch(cfg: dict[str, Any], m: int, world_size: int) -> None:
    """Every engine step is one micro-batch of m pairs per rank; ds_clip's step runs the k of a step itself."""
    cfg["train_micro_batch_size_per_gpu"] = m
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_batch_size"] = m * world_size


def quiet_engine(cfg: dict[str, Any]) -> None:
    cfg.setdefault("steps_per_print", STEPS_PER_PRINT)  # a preset may ask for DeepSpeed's prints
    cfg.setdefault("wall_clock_breakdown", False)  # a preset may ask for DeepSpeed's timers
    cfg["zero_allow_untested_optimizer"] = True  # torch AdamW under ZeRO is "untested" to DeepSpeed


def _steps(params: dict[str, Any], key: str, default: Any = None) -> int | None:
    value = params.get(key, default)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def json_schedule_warning(cfg: dict[str, Any], label: str, total_steps: int) -> str | None:
    """What the start line (and --dry-run) warns of when a JSON's scheduler block, as DeepSpeed 0.19.8 steps it
    once per optimizer step, ends before a run of ``total_steps`` does (its "auto" keys filled): WarmupDecayLR
    then trains at lr 0, WarmupCosineLR at cos_min_ratio of the peak, OneCycle at cycle_min_lr (decaying with
    decay_lr_rate); or whose warm-up is not shorter than the run (the peak is never reached). None otherwise."""
    block = cfg.get("scheduler")
    if not isinstance(block, dict) or total_steps < 1:
        return None
    kind, params = block.get("type"), block.get("params") or {}
    where = f"scheduler {kind} in {label}"
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        end = _steps(params, "total_num_steps")
        if end is not None and end < total_steps:
            after = (
                "at lr 0"
                if kind == "WarmupDecayLR"
                else f"at cos_min_ratio={js(params.get('cos_min_ratio', 0.01))} of the peak lr"
            )
            return (
                f"{where} ends at total_num_steps={end}, and the run has {total_steps} optimizer steps: the last "
                f'{total_steps - end} train {after}; set total_num_steps to {total_steps} (or "auto") or stop '
                f"the run at --max-steps {end}"
            )
    if kind == "OneCycle":
        first = _steps(params, "cycle_first_step_size", 2000)
        second = _steps(params, "cycle_second_step_size", first)
        if first is not None and second is not None and first + second < total_steps:
            decay = params.get("decay_lr_rate", 0.0)
            after = f"cycle_min_lr={js(params.get('cycle_min_lr'))}" + (
                f" decaying with decay_lr_rate={js(decay)}" if decay else ""
            )
            return (
                f"{where} ends its cycle after cycle_first_step_size + cycle_second_step_size = {first + second} "
                f"steps, and the run has {total_steps} optimizer steps: the last {total_steps - first - second} "
                f"train at {after}; lengthen the cycle or stop the run at --max-steps {first + second}"
            )
    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        warmup = _steps(params, "warmup_num_steps", 1000)
        if warmup is not None and warmup >= total_steps:
            peak = (
                f"warmup_max_lr={js(params.get('warmup_max_lr'))}"
                if kind != "WarmupCosineLR"
                else "the peak lr"
            )
            return (
                f"{where} warms up over warmup_num_steps={warmup} steps, not fewer than the run's {total_steps} "
                f"optimizer steps: the lr rises all run long and never reaches {peak}; lower warmup_num_steps"
            )
    return None
