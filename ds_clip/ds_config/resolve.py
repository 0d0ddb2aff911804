"""DeepSpeed JSON: a preset (ds_clip.ds_config.presets, engine settings only) + the run's flags -> resolved config.

    ds = resolve_deepspeed(settings.deepspeed_request(), geometry, accelerator="cuda")   # once, at start
    ds.config, ds.preset, ds.default_reason, ds.coalesce_fallback        # what the engine and the logs read
    ds.refuse_blocked()                                                  # SettingsError if it cannot run here

The preset owns the engine: ZeRO stage and buckets, offload, communication. ds_clip owns everything
that decides what a step computes: batch sizes, accumulation, optimizer, learning rate, precision,
clipping. A preset key that disagrees with a flag is an error naming both; a key that repeats the flag's
value is fine. No deepspeed import here: presets are checked before any process group starts. Nor any
import of ds_clip.config (which imports this module to check the preset): the resolution takes the flags it
reads (``DeepSpeedRequest``) and the batch geometry (``ds_clip.geometry.BatchGeometry``), not the settings tree.

Each rule is one function of ds_clip.ds_config.rules (batch keys, ZeRO stage and offload, precision, clipping,
optimizer, coalescing, the step's keys). ``resolve_deepspeed`` applies them to a preset and the flags;
``step_engine_config`` applies the ones that concern a user's own config to it, so the two agree.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_clip.ds_config.presets import (
    PRESET_DIR,
    SettingsError,
    is_auto,
    list_presets,
    load_preset,
    preset_label,
)
from ds_clip.ds_config.rules import (
    COALESCE_ENGINE_KEYS,
    STEP_ENGINE_KEYS,
    USER_SOURCE,
    DeepSpeedRequest,
    Settle,
    batch_keys,
    check_no_accumulation,
    clipping,
    coalescing,
    enabled_precision,
    engine_batch,
    fill_start_keys,
    hardware_blocker,
    js,
    json_object,
    json_schedule_warning,
    muon_reduce_scatter,
    optimizer_block,
    optimizer_section,
    precision_sections,
    quiet_engine,
    read_zero,
    refuse_fp16_on_zero0,
    refuse_not_done,
    same_value,
    scheduler_section,
    start_auto_keys,
    step_keys,
    trainer_source,
    zero_stage,
)
from ds_clip.geometry import BatchGeometry

# ---------------------------------------------------------------------------------- what runs where


def optimizer_blocker(
    optimizer: str, *, offloaded: bool, accelerator: str, asked: str | None = None
) -> str | None:
    """Why DeepSpeed 0.19.8 cannot build --opt on this accelerator ("cuda", "cpu", ...), else None.

    Measured on the CPU accelerator: "Lamb" builds FusedLamb and "Lion" FusedLion, CUDA kernels the CPU
    accelerator does not implement ("This op had not been implemented on CPU backend"); with the optimizer
    offloaded ("offloaded") "Lion" builds DeepSpeedCPULion (a C++ op, compiled on first use). AdamW and SGD
    run anywhere.
    """
    what = asked or f"--opt {optimizer}"
    if optimizer == "muon":
        import deepspeed
        from deepspeed.runtime import config as ds_runtime_config

        if not hasattr(ds_runtime_config, "MUON_OPTIMIZER"):
            return (
                f"{what}: DeepSpeed {deepspeed.__version__} has no Muon optimizer (it ships with DeepSpeed's Muon "
                "support, pull request 7509; ds_clip is tested with 0.19.8): upgrade DeepSpeed"
            )
    if accelerator == "cuda":
        return None
    if optimizer == "lamb":
        return (
            f"{what}: DeepSpeed 0.19.8 builds FusedLamb, a CUDA kernel, and this machine's accelerator is "
            f"{accelerator}: use --opt adamw, lion (with an offload preset) or sgd, or a CUDA machine"
        )
    if optimizer == "lion" and not offloaded:
        return (
            f"{what}: on the {accelerator} accelerator DeepSpeed 0.19.8 has only its CPU Lion, used when the "
            "optimizer is offloaded: add --ds-config zero2_offload_fp32 (or another *_offload_* preset)"
        )
    return None


def deepspeed_blocker(cfg: dict[str, Any], label: str) -> str | None:
    """Why DeepSpeed's own reading of the JSON refuses it, else None: a key it has removed (its
    ``_reject_removed_config_keys``: elasticity, curriculum_learning, ...), or a zero_optimization value out of its
    range (reduce_bucket_size 0 in DeepSpeed 0.19.8). One line instead of a traceback from inside
    ``deepspeed.initialize``. "auto" keys filled at start are read as 1 here."""
    import deepspeed
    import pydantic
    from deepspeed.runtime import config as ds_runtime_config
    from deepspeed.runtime.zero.config import get_zero_config

    reject = getattr(ds_runtime_config, "_reject_removed_config_keys", None)
    if reject is not None:
        try:
            reject(cfg)
        except ds_runtime_config.DeepSpeedConfigError as exc:
            key = next((k for k in cfg if k in str(exc) or f"'{k}'" in str(exc)), "a key")
            return f"{key} in {label}: DeepSpeed {deepspeed.__version__} removed it ({str(exc).split('. See')[0]})"

    zero = {k: 1 if is_auto(v) else v for k, v in (cfg.get("zero_optimization") or {}).items()}
    try:
        get_zero_config({"zero_optimization": zero})
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        return (
            f"zero_optimization.{where}={js(err.get('input'))} in {label}: DeepSpeed {deepspeed.__version__} "
            f"refuses it ({err['msg'].lower()})"
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


def precision_blocker(precision: str, accelerator: str, asked: str | None = None) -> str | None:
    """Why --precision cannot run on this machine's accelerator, else None: DeepSpeed refuses fp16 where its
    accelerator has none (``initialize`` raises ValueError "fp16 is not supported on this device"; the CPU
    accelerator has fp16 only with AVX512-FP16)."""
    if precision != "fp16" or accelerator == "cuda":
        return None
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != accelerator or acc.is_fp16_supported():
        return None
    return (
        f"{asked or '--precision amp, fp16 or pure_fp16'} (DeepSpeed fp16): this machine's {accelerator} accelerator has no fp16 "
        "support "
        "(DeepSpeed's CPU accelerator needs AVX512-FP16); use --precision amp_bf16 (bf16) or fp32"
    )


# ------------------------------------------------------------------------------------ the resolution


# Up to this many ranks an fp32 run defaults to ZeRO-0, DDP's layout (every rank holds the whole optimizer state).
# In fp32, ZeRO-1 keeps an fp32 master copy and a gradient partition beside the model's own parameters and
# gradients: per rank 8 + 16/W bytes per parameter against ZeRO-0's 16, so it saves nothing at W = 2 (measured:
# more, its flat buffers) and a quarter at W = 4, while it flattens every gradient into its partition, copies
# the updated partition back and all-gathers the parameters every step (docs/benchmarks.md, "The multi-rank
# default"). From W = 5 on (or in bf16, where ZeRO-1 saves a quarter at W = 2 and half at W = 4: its master
# copy and moments are the partitioned part) the default partitions.
ZERO0_FP32_MAX_RANKS = 4


def default_preset(s: DeepSpeedRequest, world_size: int | None) -> tuple[str, str]:
    """The preset ds-clip-train runs without --ds-config, and why (one log line): where the default is decided.

    ZeRO-1 (``zero1_<precision>``) partitions the optimizer state over the W ranks. One process has nothing to
    partition it with, and ZeRO-1 there still costs a flattened copy of every gradient and of every updated
    parameter per step (about 2x open_clip's step for ViT-B-32 at k=1 on a CPU, docs/benchmarks.md), so W = 1
    defaults to ZeRO-0, and so do fp32 runs on up to ZERO0_FP32_MAX_RANKS ranks (where ZeRO-1 saves little or
    no memory), unless a flag needs ZeRO: --zero-stage (then the ZeRO-1 preset's buckets with that stage, as
    before), --coalesce-grad-reduction on (ZeRO 1-3 only) or --precision fp16 (refused on ZeRO-0).
    ``world_size`` None (validation, before the process group): the multi-rank default, whose checks cover
    ZeRO-0's.
    """
    p = s.precision
    explicit = s.zero_stage is not None or s.coalesce_grad_reduction == "on"
    if world_size is None or (
        world_size > 1 and (explicit or p != "fp32" or world_size > ZERO0_FP32_MAX_RANKS)
    ):
        why = f"{world_size or 'W'} ranks: ZeRO-1 partitions the optimizer state over them"
        if world_size is not None and p == "fp32" and not explicit:
            why += f" (fp32 runs on up to {ZERO0_FP32_MAX_RANKS} ranks default to ZeRO-0)"
        return f"zero1_{p}", why
    if world_size > 1:
        return f"zero0_{p}", (
            f"{world_size} fp32 ranks: ZeRO-1 would save little or no memory per rank here (its fp32 master and "
            "gradient partitions cost back what partitioning the moments saves) and copy every gradient and "
            "parameter once more per step; every rank holds the whole optimizer state, as DDP does "
            "(--zero-stage N or --ds-config NAME to choose)"
        )
    if s.zero_stage is not None:
        return f"zero1_{p}", f"one process, --zero-stage {s.zero_stage} on this preset's ZeRO settings"
    if s.coalesce_grad_reduction == "on":
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
    precision_blocker: str | None = None
    """Why --precision cannot run on ``accelerator`` (``precision_blocker``), else None."""
    hardware_blocker: str | None = None
    """Why ``accelerator`` cannot serve a key of the JSON (NVMe offload, CUDA-only ops), else None."""
    deepspeed_blocker: str | None = None
    """Why DeepSpeed's own reading refuses the JSON: a removed key, a zero_optimization value out of range."""
    notes: tuple[str, ...] = ()
    """One line each: what the JSON's keys became (k as cached accumulation, torch_autocast's precision) and
    every passed flag that kept its value over the file's; logged at start and printed by --dry-run."""
    sources: tuple[tuple[str, str], ...] = ()
    """Every effective key (dotted path) and where its value came from: "flag --lr", "JSON file", "auto <- ...",
    "default (--lr)", "ds_clip (...)" (``key_sources``)."""
    start_keys: tuple[tuple[str, str], ...] = ()
    """"auto" keys filled at start (``fill_start_keys``: the model's hidden size, the run's length) and from what."""

    @property
    def config(self) -> dict[str, Any]:
        """The resolved JSON as a new dict (for ``deepspeed.initialize(config=...)``; yours to change)."""
        return json.loads(self.json_text)

    def refuse_blocked(self) -> None:
        """SettingsError with the first reason this machine cannot run the settings (before DeepSpeed fails
        inside its op builder, or torch in the first forward)."""
        for why_not in (
            self.hardware_blocker,
            self.deepspeed_blocker,
            self.precision_blocker,
            self.optimizer_blocker,
            self.bn_sync_blocker,
        ):
            if why_not is not None:
                raise SettingsError(why_not)


def resolve_deepspeed(
    s: DeepSpeedRequest, geometry: BatchGeometry | None, *, accelerator: str | None = None
) -> ResolvedDeepSpeed:
    """Preset or JSON + the run's flags -> the resolved DeepSpeed side of a run; SettingsError naming the key (and
    the flag) that cannot run.

    ``geometry`` None (validation, before any process group): every rule but the batch keys' world size.
    With the geometry (``ds_clip.config.resolve_geometry``), the JSON has train_batch_size = m * W and
    gradient_accumulation_steps = 1: every engine step is one micro-batch; ds_clip's step runs the k
    micro-batches of an optimizer step itself. ``accelerator`` (``ds_clip.distributed.accelerator_name()``):
    also decide what it cannot run.
    """
    world_size = None if geometry is None else geometry.world_size
    o = s.optim
    default_reason = None
    if s.ds_config is None:
        preset, default_reason = default_preset(s, world_size)
    else:
        preset = s.ds_config
    src = trainer_source(preset)
    original = load_preset(preset)
    cfg = copy.deepcopy(original)
    settle = Settle(src.label, s)
    notes = refuse_not_done(cfg, src.label)
    notes += batch_keys(cfg, src, s, world_size)
    zero = zero_stage(cfg, src.label, s)
    precision_sections(cfg, settle, zero.stage)
    clipping(cfg, settle, o.grad_clip_norm)
    optimizer_section(cfg, settle, o, zero)
    muon_reduce_scatter(cfg, settle, o, zero, shipped=not str(preset).endswith(".json"))
    scheduler = scheduler_section(cfg, settle, o)
    if scheduler is not None and s.sources is None:
        raise SettingsError(
            f"scheduler in {src.label}: ds_clip runs its own LR schedule (--lr-scheduler, --lr, --warmup) for "
            "settings not parsed from a command line; remove the scheduler section"
        )
    required, blocker = coalescing(cfg, s.coalesce_grad_reduction, zero, s.precision, src)
    step_keys(cfg, required, src)
    if geometry is not None:
        engine_batch(cfg, geometry.micro_batch_size, geometry.world_size)
    quiet_engine(cfg)
    start_keys = start_auto_keys(cfg, src.label)
    blockers: dict[str, str | None] = {}
    if accelerator is not None:
        sources = s.sources or {}
        opt_asked = (
            f"optimizer.type={js(cfg['optimizer']['type'])} in {src.label}"
            if sources.get("optimizer") == "ds_json"
            else None
        )
        prec_asked = (
            f"the enabled fp16 section of {src.label}" if sources.get("precision") == "ds_json" else None
        )
        blockers = dict(
            optimizer_blocker=optimizer_blocker(
                o.optimizer, offloaded=zero.cpu_optimizer, accelerator=accelerator, asked=opt_asked
            ),
            bn_sync_blocker=bn_sync_blocker(s.use_bn_sync, accelerator),
            precision_blocker=precision_blocker(s.precision, accelerator, prec_asked),
            hardware_blocker=hardware_blocker(cfg, src.label, accelerator),
            deepspeed_blocker=deepspeed_blocker(cfg, src.label),
        )
    return ResolvedDeepSpeed(
        json_text=json.dumps(cfg, indent=2),
        preset=preset,
        default_reason=default_reason,
        coalesce_fallback=blocker if s.coalesce_grad_reduction == "auto" else None,
        world_size=world_size,
        accelerator=accelerator,
        notes=tuple(notes + settle.notes),
        sources=tuple(key_sources(original, cfg, s, settle.filled, start_keys)),
        start_keys=tuple(start_keys.items()),
        **blockers,
    )


# The keys that hold a setting's value, by dotted path -> the field (its flag names it).
_KEY_FIELDS = {
    "train_micro_batch_size_per_gpu": "batch_size",
    "gradient_clipping": "grad_clip_norm",
    "optimizer.type": "optimizer",
    "optimizer.params.lr": "lr",
    "optimizer.params.betas": "beta1",
    "optimizer.params.eps": "eps",
    "optimizer.params.weight_decay": "wd",
    "optimizer.params.momentum": "momentum",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
    "zero_optimization.stage": "zero_stage",
    "scheduler.params.warmup_num_steps": "warmup",
    "scheduler.params.warmup_max_lr": "lr",
}
_OPTIONS = {
    "batch_size": "--batch-size", "grad_clip_norm": "--grad-clip-norm", "optimizer": "--opt", "lr": "--lr",
    "beta1": "--beta1/--beta2", "eps": "--eps", "wd": "--wd", "momentum": "--momentum", "precision": "--precision",
    "zero_stage": "--zero-stage", "warmup": "--warmup",
}  # fmt: skip
_MISSING = object()


def _leaves(node: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    return [(path, node)]


def _lookup(node: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def key_sources(
    original: dict[str, Any], cfg: dict[str, Any], s: DeepSpeedRequest, filled: dict[str, str],
    start_keys: dict[str, str],
) -> list[tuple[str, str]]:  # fmt: skip
    """Where each effective key of ``cfg`` came from, next to the file the user gave (``original``): "flag --x",
    "recipe", "JSON file", "auto <- ..." (filled from a flag or a default), "default (--x)" or "ds_clip (...)"
    (a key ds_clip's step sets itself)."""
    sources = s.sources or {}

    def field_source(fld: str) -> str:
        option = _OPTIONS[fld]
        how = sources.get(fld)
        if how == "flag" or (s.sources is None):
            return f"flag {option}"
        if how == "recipe":
            return f"recipe ({option})"
        if how in ("ds_json", "derived"):
            return "JSON file"
        return f"default ({option})"

    out = []
    for path, value in _leaves(cfg):
        before = _lookup(original, path)
        fld = _KEY_FIELDS.get(path)
        if path in start_keys:
            out.append((path, f"auto <- {start_keys[path]}"))
        elif is_auto(before):
            what = filled.get(path)
            out.append((path, f"auto <- {field_source(fld) if fld else what or 'ds_clip'}"))
        elif path in ("train_batch_size", "gradient_accumulation_steps"):
            out.append((path, "ds_clip (one micro-batch per engine step; k runs as cached accumulation)"))
        elif before is not _MISSING and same_value(before, value):
            out.append((path, "JSON file"))
        elif fld is not None:
            out.append((path, field_source(fld)))
        elif before is not _MISSING:
            out.append((path, "ds_clip (over the file's value)"))
        else:
            out.append((path, "ds_clip"))
    return out


def derived_k_text(s: Any, world_size: int) -> str:
    """The start line's account of a k derived from the global batch N, naming where N came from (--global-batch-
    size, or the file's train_batch_size); "" where k was not derived. ``s``: the run's ``TrainSettings``."""
    n = s.optim.global_batch_size
    if n is None:
        return ""
    source = (
        f"train_batch_size={n} in {preset_label(s.dist.ds_config)}"
        if (s.sources or {}).get("global_batch_size") == "ds_json" and s.dist.ds_config is not None
        else f"the recipe's --global-batch-size {n}"
        if (s.sources or {}).get("global_batch_size") == "recipe"
        else f"--global-batch-size {n}"
    )
    return f" (k derived from {source} on {world_size} rank{'s' if world_size != 1 else ''})"


def format_sources(
    ds: ResolvedDeepSpeed, cfg: dict[str, Any] | None = None, geometry: BatchGeometry | None = None
) -> str:
    """--dry-run's table: every effective DeepSpeed key, its value and where it came from. ``cfg``: the JSON with
    its start keys filled (default: ``ds.config``); with ``geometry``, the batch keys show the optimizer step's
    N and k, as the user counts them, beside what the engine runs."""
    cfg = ds.config if cfg is None else cfg
    rows = [(path, js(_lookup(cfg, path)), source) for path, source in ds.sources]
    if geometry is not None:
        g = geometry
        engine = f"the engine runs one micro-batch per step: train_batch_size m x W = {g.micro_batch_size * g.world_size}"
        shown = {
            "train_batch_size": (js(g.global_batch), f"N = m x k x W = {g.micro_batch_size} x {g.accum_freq} x "
                                 f"{g.world_size} pairs per optimizer step ({engine} in ds_config.json)"),
            "gradient_accumulation_steps": (js(g.accum_freq), "k, run as ds_clip's exact cached accumulation "
                                            "(gradient_accumulation_steps 1 in ds_config.json)"),
        }  # fmt: skip
        rows = [(p, *shown[p]) if p in shown else (p, v, src) for p, v, src in rows]
    width = max(len(p) for p, _, _ in rows)
    vwidth = min(24, max(len(v) for _, v, _ in rows))
    return "\n".join(f"{p:<{width}}  {v:<{vwidth}}  {src}" for p, v, src in rows)


def check_preset(s: DeepSpeedRequest) -> None:
    """Raise SettingsError if the preset is missing, unreadable or disagrees with the flags.

    Called from config.validate before the world size is known; train_batch_size is checked at start.
    """
    resolve_deepspeed(s, None)


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
    src = USER_SOURCE
    label = src.label
    cfg = copy.deepcopy(config)
    check_no_accumulation(cfg.get("gradient_accumulation_steps", 1), src)
    cfg["gradient_accumulation_steps"] = 1
    if "train_batch_size" in cfg and "train_micro_batch_size_per_gpu" in cfg:
        raise SettingsError(
            f"train_batch_size={js(cfg['train_batch_size'])} in {label}: with cached_step the engine's batch "
            "is one micro-batch per rank; keep train_micro_batch_size_per_gpu (m) alone, DeepSpeed derives "
            "train_batch_size = m x world size"
        )
    for key in ("zero_optimization", "bf16", "bfloat16", "fp16"):
        json_object(cfg, key, label)
    zero = read_zero(cfg.get("zero_optimization", {}), label)
    precision = enabled_precision(cfg)
    refuse_fp16_on_zero0(
        precision, zero.stage, f"fp16 with ZeRO stage 0 in {label}", "bf16 or ZeRO stage 1, 2 or 3"
    )
    required, _ = coalescing(cfg, "on" if coalesce else "off", zero, precision, src)
    step_keys(cfg, required, src)
    return cfg


def write_run_files(
    run_dir: Path,
    settings: dict[str, Any],
    ds: ResolvedDeepSpeed,
    engine_config: dict[str, Any] | None = None,
) -> None:
    """Write settings.json (`config.settings_to_dict`) and ds_config.json (the resolved JSON, indented; or
    ``engine_config``, the one the engine was built from, its start "auto" keys filled) into the run folder.
    Rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    text = ds.json_text if engine_config is None else json.dumps(engine_config, indent=2)
    (run_dir / "ds_config.json").write_text(text + "\n")


__all__ = [
    "PRESET_DIR",  # re-exported from ds_clip.ds_config.presets, where the preset files are found
    "COALESCE_ENGINE_KEYS",
    "STEP_ENGINE_KEYS",
    "DeepSpeedRequest",
    "ResolvedDeepSpeed",
    "SettingsError",
    "derived_k_text",
    "fill_start_keys",
    "format_sources",
    "json_schedule_warning",
    "bn_sync_blocker",
    "check_preset",
    "default_preset",
    "list_presets",
    "load_preset",
    "optimizer_block",
    "optimizer_blocker",
    "preset_label",
    "resolve_deepspeed",
    "step_engine_config",
    "write_run_files",
]
