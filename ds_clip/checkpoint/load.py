"""Loading: the checks a resume makes (model, global batch, optimizer flags), safe unpickling, and the
load itself, on the same or another world size or ZeRO stage."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ds_clip.checkpoint.find import (
    read_meta,
    resolve,
)
from ds_clip.checkpoint.layout import (
    MARKER,
    UNIVERSAL_PREFIX,
    CheckpointError,
    _rank,
    _world,
)
from ds_clip.checkpoint.rng import (
    set_rng_state,
)
from ds_clip.checkpoint.universal import write_zero_universal
from ds_clip.distributed import barrier as _barrier
from ds_clip.distributed import broadcast_object
from ds_clip.errors import UserError
from ds_clip.geometry import BatchGeometry


class ResumeSettingsError(UserError):
    """A resume whose optimizer flags differ from the checkpoint's: the load would silently undo them."""


# Optimizer hyperparameters a resume cannot change: DeepSpeed's load restores each parameter group's lr,
# weight_decay, betas and eps from the optimizer state, and the LR scheduler's state restores every group's
# peak (base_lrs). A changed flag would be parsed, logged, and then overwritten by the old value. The
# schedule's shape (--warmup, --lr-scheduler, --epochs...) is rebuilt from the flags and does take effect.
# --opt too: the optimizer state of one optimizer is no state of another (a checkpoint without the key is from
# before --opt, i.e. AdamW).
RESUME_FIXED = ("lr", "visual_lr", "text_lr", "wd", "visual_wd", "text_wd", "visual_ld", "text_ld",
                "beta1", "beta2", "eps", "optimizer", "momentum")  # fmt: skip
_RESUME_FLAGS = {"optimizer": "--opt"}  # fields whose flag is not "--" + the name
# Per-tower flags default to the shared one (--visual-lr none = --lr): compare what each resolves to.
_RESUME_DEFAULTS = {"visual_lr": "lr", "text_lr": "lr", "visual_wd": "wd", "text_wd": "wd"}


def check_resume_settings(saved: dict[str, Any], current: dict[str, Any], flag: str) -> None:
    """Raise ResumeSettingsError naming each optimizer flag whose value differs from the checkpoint's run."""

    def resolved(settings: dict[str, Any], name: str) -> Any:
        value = settings.get(name)
        return settings.get(_RESUME_DEFAULTS[name]) if value is None and name in _RESUME_DEFAULTS else value

    changed = [
        f"{_RESUME_FLAGS.get(n, '--' + n.replace('_', '-'))} {resolved(saved, n)} there, {resolved(current, n)} here"
        for n in RESUME_FIXED
        if n in saved and resolved(saved, n) != resolved(current, n)
    ]
    if changed:
        raise ResumeSettingsError(
            f"{flag}: the checkpoint's optimizer state would silently restore its own values of "
            f"{'; '.join(changed)}. Resume with the checkpoint's values, or export it (ds-clip-export) and "
            "start a new run with --pretrained and the new values"
        )


def _deepspeed_safe_globals() -> list:
    # The few non-tensor classes DeepSpeed 0.19.x pickles into its checkpoint files; anything else
    # would need arbitrary unpickling and is refused.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, flag: str = "--resume") -> Any:
    """torch.load with ``weights_only=True`` (tensors, containers and DeepSpeed's own few types).

    A file that needs arbitrary unpickling could run code on load: refuse it with an explanation.
    """
    import pickle

    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{flag}: {path} needs arbitrary unpickling to load (torch.load weights_only=True refused it: "
            f"{first[:200]}); ds_clip only loads tensors and DeepSpeed's own types from files, because "
            "unpickling can run code. Re-save it as a plain state dict or safetensors from a source you trust."
        ) from exc


def install_safe_loading(engine) -> None:
    """Make DeepSpeed's own checkpoint reads go through ``safe_load`` (it passes weights_only=False)."""
    ce = engine.checkpoint_engine
    if ce is not None and not getattr(ce, "_ds_clip_safe", False):
        ce.load = lambda path, map_location=None: safe_load(path)
        ce._ds_clip_safe = True


def check_compatible(
    meta: dict[str, Any], flag: str, *, shapes: dict[str, list[int]], global_batch: int, world_size: int
) -> None:
    """Raise CheckpointError if the checkpoint's model or global batch differ from this run's."""
    saved = meta["param_shapes"]
    if saved != shapes:
        missing = sorted(set(shapes) - set(saved))
        extra = sorted(set(saved) - set(shapes))
        differ = sorted(n for n in set(saved) & set(shapes) if saved[n] != shapes[n])
        detail = (
            f"missing in checkpoint: {missing[:3]}"
            if missing
            else f"not in this model: {extra[:3]}"
            if extra
            else f"{differ[0]} is {saved[differ[0]]} there, {shapes[differ[0]]} here"
        )
        raise CheckpointError(
            f"{flag}: incompatible model: the checkpoint was saved from --model {meta.get('model')!r} ({detail}); "
            "resume with the same --model, or export it (ds-clip-export) and fine-tune with --pretrained"
        )
    saved = BatchGeometry(meta["world_size"], meta["accum_freq"], meta["micro_batch_size"])
    if saved.global_batch != global_batch:
        hint = f": use --global-batch-size {saved.global_batch}"
        try:  # or the --accum-freq that keeps the saved N on this run's ranks with the saved micro-batch
            keep = BatchGeometry.for_global_batch(world_size, saved.micro_batch_size, saved.global_batch)
            hint += f" (or --batch-size {keep.micro_batch_size} --accum-freq {keep.accum_freq})"
        except ValueError:
            pass
        raise CheckpointError(
            f"{flag}: the checkpoint trained global batch N = W*k*m = {saved.world_size}*{saved.accum_freq}*"
            f"{saved.micro_batch_size} = {saved.global_batch}, this run {global_batch}; a resume keeps N{hint} (or "
            "start a new run with --pretrained from an export)"
        )


def load(
    engine,
    run_dir: Path | None,
    resume: str,
    *,
    shapes: dict[str, list[int]] | None = None,
    global_batch: int | None = None,
    settings: dict[str, Any] | None = None,
    agreed: Path | None = None,
) -> dict[str, Any]:
    """Every rank calls this; returns {'step', 'epoch', 'samples_seen', 'data', 'path', 'meta', 'resharded',
    'rng_from' (the saved rank whose RNG state this rank took), 'restored' (``restored_summary``)}.
    ``agreed``: the checkpoint folder the ranks agreed on at start (``resolve``), loaded without looking up
    ``--resume`` again.

    ``shapes`` (param_shapes of the model before deepspeed.initialize) and ``global_batch`` are checked
    against the checkpoint first, for a clear error instead of DeepSpeed's size mismatch; ``settings`` (this
    run's, flat) for optimizer flags the load would silently undo (``check_resume_settings``).
    """
    install_safe_loading(engine)
    flag = f"--resume {resume}"
    path = resolve(run_dir, resume, agreed=agreed)
    meta = read_meta(path)
    world, rank = _world(), _rank()
    if shapes is not None and global_batch is not None:
        check_compatible(meta, flag, shapes=shapes, global_batch=global_batch, world_size=world)
    if settings is not None and meta.get("settings"):
        check_resume_settings(meta["settings"], settings, flag)
    stage = int(engine.zero_optimization_stage())
    same_shape = meta["world_size"] == world and meta["zero_stage"] == stage
    try:
        if same_shape or (meta["zero_stage"] == 0 and stage == 0 and not _has_zero_files(path)):
            # ZeRO-0 fp32 saves the whole optimizer state in one file: any world size loads it.
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name)
            if load_path is None:
                raise CheckpointError(f"{flag}: DeepSpeed found no checkpoint in {path}")
        else:
            _load_other_shape(engine, path, meta, stage, flag, run_dir)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as exc:
        raise CheckpointError(f"{flag}: cannot load {path}: {type(exc).__name__}: {exc}") from exc
    apply_schedule(engine)  # every path: the lr the restored schedule gives the next step
    # This rank's data position and RNG; on another world size, rank 0's position (the data loader counts
    # whole micro-batches from it) and the RNG state of rank r mod W_saved.
    own = path / f"rank{rank}.json"
    src = own if meta["world_size"] == world else path / f"rank{rank % meta['world_size']}.json"
    per_rank = json.loads(src.read_text())
    data_state = (
        per_rank["data"]
        if meta["world_size"] == world
        else json.loads((path / "rank0.json").read_text())["data"]
    )
    set_rng_state(per_rank["rng"])
    return {
        "rng_from": int(src.stem[len("rank") :]),
        "restored": restored_summary(engine),
        "step": int(meta["step"]),
        "epoch": meta.get("epoch"),
        "samples_seen": meta.get("samples_seen"),
        "data": data_state,
        "path": str(path),
        "meta": meta,
        "resharded": not same_shape,
    }


def _has_zero_files(path: Path) -> bool:
    return any(path.glob("*zero_pp_rank_*_optim_states.pt"))


def _universal_dir(path: Path, meta: dict[str, Any], run_dir: Path | None, flag: str) -> Path:
    """``path`` in DeepSpeed's universal layout (zero/<parameter name>/{fp32,<every optimizer state key>}.pt),
    written once by rank 0 next to this run's checkpoints: by ``universal.write_zero_universal`` from a ZeRO 1-3
    checkpoint, by ``_stage0_to_universal`` from a ZeRO-0 one."""

    out_root = (run_dir / "checkpoints") if run_dir is not None else path.parent
    out = out_root / f"{UNIVERSAL_PREFIX}{path.parent.parent.name}-{path.name}"
    error = [None]
    if _rank() == 0 and not (out / MARKER).exists():
        try:
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            if _has_zero_files(path):
                write_zero_universal(path, out, int(meta["zero_stage"]))
            else:
                _stage0_to_universal(path, meta, out, flag)
            (out / MARKER).write_text(path.name)
        except CheckpointError as exc:  # already one line for the user
            error[0] = ("own", str(exc))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error[0] = ("conversion", f"{type(exc).__name__}: {exc}")
    error[0] = broadcast_object(error[0], src=0)
    if error[0] is not None:
        if _rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
        kind, text = error[0]
        if kind == "own":
            raise CheckpointError(text)
        raise CheckpointError(
            f"{flag}: converting {path} to DeepSpeed's universal checkpoint failed ({text}); resume on "
            "the world size and ZeRO stage it was saved with, or export it and fine-tune with --pretrained"
        )
    return out


def _stage0_to_universal(path: Path, meta: dict[str, Any], out: Path, flag: str) -> None:
    """A ZeRO-0 checkpoint (one file: the module and the whole optimizer state) in DeepSpeed's universal layout.

    The layout ``ds_to_universal`` writes, which DeepSpeed's own ZeRO-1/2 universal load reads: per parameter
    name ``fp32.pt`` and one file per optimizer state ({"param": full tensor}), ``step.pt`` as the optimizer
    keeps it; ``zero/optimizer_state.pt`` with the groups' hyperparameters; the model-states file beside (LR
    scheduler, step counters). The fp32 masters: the module's own weights in fp32, the wrapper's ``fp32_groups``
    in bf16/fp16 (never the rounded working copy). The torch state numbers parameters in group order: the
    names come from the checkpoint's meta (``optimizer_param_names``, recorded at save).
    """
    import deepspeed

    names = meta.get("optimizer_param_names")
    if not names:
        raise CheckpointError(
            f"{flag}: {path} is a ZeRO-0 checkpoint saved without its optimizer's parameter names (an older "
            "ds_clip); resume it with --zero-stage 0, or export it and fine-tune with --pretrained"
        )
    model_file = sorted(path.glob("*mp_rank_00_model_states.pt"))[0]
    state = safe_load(model_file)
    saved = state["optimizer"]
    # The bf16/fp16 wrapper keeps torch's state one level down.
    inner = saved.get("optimizer_state_dict", saved)
    masters = saved.get("fp32_groups")
    zero = out / "zero"
    for g, (group_names, group) in enumerate(zip(names, inner["param_groups"], strict=True)):
        for i, (name, index) in enumerate(zip(group_names, group["params"], strict=True)):
            folder = zero / name
            folder.mkdir(parents=True)
            fp32 = _engine_shape(masters[g][i] if masters is not None else state["module"][name])
            torch.save({"param": fp32}, folder / "fp32.pt")
            for key, value in inner["state"].get(index, {}).items():
                if key == "step":
                    torch.save(value, folder / "step.pt")
                elif torch.is_tensor(value) and value.numel() == fp32.numel():
                    torch.save({"param": _engine_shape(value)}, folder / f"{key}.pt")
    # Frozen parameters and buffers: their values, as ds_to_universal writes them.
    for name, tensor in state["module"].items():
        if not (zero / name).exists() and tensor.is_floating_point():
            (zero / name).mkdir(parents=True)
            torch.save({"param": _engine_shape(tensor)}, zero / name / "fp32.pt")
    groups = [{k: v for k, v in group.items() if k != "params"} for group in inner["param_groups"]]
    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__}, zero / "optimizer_state.pt")
    shutil.copy2(model_file, out / model_file.name)


def _engine_shape(t: torch.Tensor) -> torch.Tensor:
    """fp32, with open_clip's 0-dim parameters (logit_scale, logit_bias) in the engine's shape [1]
    (ds_clip.models.model.prepare_for_deepspeed): the shape DeepSpeed's universal load compares with."""
    t = t.detach().float().clone()
    return t.reshape(1) if t.dim() == 0 else t


def _load_other_shape(engine, path: Path, meta: dict[str, Any], stage: int, flag: str, run_dir) -> None:
    """Another world size or ZeRO stage: through the universal layout (``_universal_dir``), loaded by DeepSpeed
    on ZeRO-1/2, by ds_clip on ZeRO-3 and ZeRO-0 (DeepSpeed 0.19.8 loads universal checkpoints on ZeRO-1/2 only).
    Every saved state must find its home in this engine first (``check_homes``)."""
    universal = _universal_dir(path, meta, run_dir, flag)
    try:
        check_homes(engine, universal / "zero", flag)
        if stage in (1, 2):
            # DeepSpeed's own universal load is exact for ZeRO-1/2 (tested) and reads every <key>.pt of a
            # parameter's folder, the loss scaler from optimizer_state.pt; the engine reads this switch at load.
            config = engine._config
            saved, config.load_universal_checkpoint = config.load_universal_checkpoint, True
            try:
                load_path, _ = engine.load_checkpoint(str(universal.parent), tag=universal.name)
            finally:
                config.load_universal_checkpoint = saved
            if load_path is None:
                raise CheckpointError(f"{flag}: DeepSpeed found no checkpoint in {universal}")
            if stage == 2:
                _muon_whole_momentum(engine, universal / "zero")
            _load_common(engine, path, buffers_only=True)  # a universal load leaves the module's buffers
        else:
            if stage == 3:
                _load_resharded(engine, universal / "zero")
            else:
                _load_unpartitioned(engine, universal / "zero")
            _load_loss_scaler(engine, universal / "zero")
            _load_common(engine, path)
    finally:
        # The converted copy (full fp32 weights and moments) is only a means of loading: drop it once all
        # ranks have read it; the next save of this run is a normal checkpoint on the new world size.
        _barrier()
        if _rank() == 0:
            shutil.rmtree(universal, ignore_errors=True)
            _drop_universal_pointer(universal)


UNIVERSAL_POINTER = "latest_universal"
"""The file DeepSpeed's ``ds_to_universal`` writes beside the folder it converts into, naming that folder."""


def _drop_universal_pointer(out: Path) -> None:
    """Remove ``latest_universal`` from beside ``out`` when it names ``out``. ds_clip loads the converted copy by
    its path and deletes it once loaded, so the pointer would name a deleted folder; one naming another folder
    (a conversion of the user's own) is left alone."""
    pointer = out.parent / UNIVERSAL_POINTER
    with contextlib.suppress(OSError):
        if pointer.read_text().strip() == out.name:
            pointer.unlink()


def _muon_whole_momentum(engine, zero_dir: Path) -> None:
    """ZeRO-2 with Muon: DeepSpeed keeps a Muon group's momentum as the whole momentum of every matrix that touches
    this rank's partition, one after the other (Newton-Schulz needs whole matrices; ZeRO-1 keeps the partition's
    slice), so its universal load (partition slices) leaves a buffer of the wrong size: build it that way."""
    opt = engine.optimizer
    if type(_inner(opt)).__name__ != "MuonWithAuxAdam":
        return
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for g, params in enumerate(opt.params_in_partition):
        if not params or not all(getattr(p, "use_muon", False) for p in params):
            continue
        flat = opt.single_partition_of_fp32_groups[g]
        whole = torch.cat([_full(zero_dir / names[id(p)] / "momentum_buffer.pt").flatten() for p in params])
        opt.optimizer.state[flat]["momentum_buffer"] = whole.to(device=flat.device, dtype=flat.dtype)


def _load_common(engine, path: Path, *, buffers_only: bool = False) -> None:
    """What is not per parameter: LR scheduler, engine counters, module buffers (BatchNorm statistics)."""
    files = sorted(path.glob("*mp_rank_00_model_states.pt"))
    state = safe_load(files[0])
    if not buffers_only and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if not buffers_only:
        engine.global_steps = state.get("global_steps", engine.global_steps)
        engine.global_samples = state.get("global_samples", engine.global_samples)
    module_state = state.get("module") or {}
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            if name in module_state:
                buf.copy_(module_state[name].to(buf.dtype).view_as(buf))


def apply_schedule(engine) -> None:
    """Every group's lr as the restored schedule gives it for the next step, written into the optimizer."""
    schedule_next_lr(engine.lr_scheduler, engine.optimizer.param_groups)


def schedule_next_lr(sched, param_groups: list[dict[str, Any]]) -> None:
    """After a load: each group's lr is the schedule's lr at the restored position, which the next step trains at.

    A scheduler writes the lr into the groups only when it steps, and a checkpoint restores the lr its own run set:
    - ds_clip's schedule (``--lr-scheduler``: a ``LambdaLR``) is rebuilt from this launch's flags (--epochs,
      --max-steps, --warmup may change on a resume, as in open_clip): its closed form at the loaded step, or the
      first resumed step would train at the old schedule's lr and only the steps after it at the new one;
    - DeepSpeed's (WarmupLR, WarmupDecayLR, WarmupCosineLR: the JSON's scheduler block) save only
      ``last_batch_iteration``, and their ``get_last_lr()`` keeps the construction value (0 for a warm-up from 0)
      until the next step: computed from the restored position, as their own ``step()`` would."""
    if sched is None:
        return
    if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        sched._last_lr = [
            base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
        ]
    elif hasattr(sched, "last_batch_iteration") and sched.last_batch_iteration >= 0:
        sched._last_lr = list(sched.get_lr())
    for group, lr in zip(param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = lr


def _full(file: Path) -> torch.Tensor:
    t = safe_load(file)
    return (t["param"] if isinstance(t, dict) else t).float()


def _saved_step(folder: Path) -> Any:
    """The optimizer's step count of one parameter in a universal checkpoint (None: its group counts none)."""
    f = folder / "step.pt"
    if not f.exists():
        return None
    s = safe_load(f)
    return s["param"] if isinstance(s, dict) else s


def _step_like(base, value: Any, device) -> Any:
    """A saved step count in the form ``base`` keeps it: torch's optimizers a float32 tensor by the parameter,
    DeepSpeed's (Muon's AdamW, CPU Adam) a number."""
    if type(base).__module__.startswith("torch.optim"):
        return torch.tensor(float(value), dtype=torch.float32, device=device)
    return value.item() if torch.is_tensor(value) else value


def _saved_keys(folder: Path) -> set[str]:
    return {f.stem for f in folder.glob("*.pt")} - {"fp32"}


def _inner(opt):
    """The torch (or DeepSpeed) optimizer that holds the state, inside DeepSpeed's ZeRO and bf16/fp16 wrappers."""
    return getattr(opt, "optimizer", opt)


def expected_state_keys(engine, p: torch.nn.Parameter) -> set[str] | None:
    """The state keys the engine's optimizer keeps for parameter ``p`` once it has stepped (None: an optimizer
    ds_clip does not know, whose keys are not checked). Its options (momentum, amsgrad) are the same in every
    group; Muon's split is the parameter's own ``use_muon`` tag."""
    base = _inner(engine.optimizer)
    kind = type(base).__name__
    group = engine.optimizer.param_groups[0]
    adam = {"exp_avg", "exp_avg_sq", "step"}
    if kind in ("AdamW", "Adam", "DeepSpeedCPUAdam", "FusedAdam"):
        return adam | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
    if kind == "SGD":
        return {"momentum_buffer"} if group.get("momentum") else set()
    if kind == "MuonWithAuxAdam":
        return {"momentum_buffer"} if getattr(p, "use_muon", False) else adam
    return None


def check_homes(engine, zero_dir: Path, flag: str) -> None:
    """Refuse, in one line, a move in which a saved state has no home in this engine, or a state this engine's
    optimizer keeps is missing from the checkpoint (it would restart from zero): never a silent reset. The fp16
    dynamic loss scale too: saved under fp16, it has no home in a bf16 or fp32 engine."""
    common = safe_load(zero_dir / "optimizer_state.pt")
    scaler = common.get("loss_scaler")
    if getattr(scaler, "dynamic", False) and not engine.fp16_enabled():
        raise CheckpointError(
            f"{flag}: the checkpoint trained with fp16 and carries its dynamic loss scale ({scaler.cur_scale:g}), "
            "which has no home in this run's precision; resume with --precision fp16, or export it and fine-tune "
            "with --pretrained"
        )
    kind = type(_inner(engine.optimizer)).__name__
    for name, p in engine.module.named_parameters():
        want = expected_state_keys(engine, p)
        if want is None:
            return
        if not p.requires_grad:
            continue
        have = _saved_keys(zero_dir / name)
        extra, missing = sorted(have - want), sorted(want - have)
        if extra:
            raise CheckpointError(
                f"{flag}: the checkpoint's optimizer state {', '.join(extra)} of {name} has no home in this run's "
                f"{kind} (it keeps {', '.join(sorted(want)) or 'no state'} there); resume with the optimizer it "
                "was saved with"
            )
        if missing:
            raise CheckpointError(
                f"{flag}: this run's {kind} keeps {', '.join(missing)} for {name}, which the checkpoint does not "
                "hold: it would restart from zero; resume with the optimizer it was saved with"
            )


def _load_loss_scaler(engine, zero_dir: Path) -> None:
    """ZeRO-0 and ZeRO-3 (DeepSpeed's ZeRO-1/2 universal load does it itself): the saved fp16 loss scaler."""
    common = safe_load(zero_dir / "optimizer_state.pt")
    scaler = common.get("loss_scaler")
    if scaler is not None and engine.fp16_enabled() and hasattr(engine.optimizer, "loss_scaler"):
        engine.optimizer.loss_scaler = scaler
        engine.optimizer.dynamic_loss_scale = common.get("dynamic_loss_scale", scaler.dynamic)


def _load_unpartitioned(engine, zero_dir: Path) -> None:
    """ZeRO-0: full per-parameter fp32 weights and every optimizer state (the universal layout) into the torch
    optimizer's state and the module; with bf16/fp16, into the wrapper's fp32 masters and the working copies."""
    opt = engine.optimizer
    working = getattr(opt, "fp16_groups", None)
    masters = getattr(opt, "fp32_groups", None) if working is not None else None
    base = opt.optimizer if working is not None else opt
    if working is None:
        working = masters = [g["params"] for g in opt.param_groups]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    common = safe_load(zero_dir / "optimizer_state.pt")
    for g, (lp_group, hp_group) in enumerate(zip(working, masters, strict=True)):
        for lp, hp in zip(lp_group, hp_group, strict=True):
            folder = zero_dir / names[id(lp)]
            if not (folder / "fp32.pt").exists():
                raise CheckpointError(
                    f"universal checkpoint {zero_dir} has no state for parameter {names[id(lp)]}"
                )
            with torch.no_grad():
                hp.copy_(_full(folder / "fp32.pt").view_as(hp))
                if lp is not hp:
                    lp.copy_(hp.to(lp.dtype))
            state = base.state[hp]
            for f in folder.glob("*.pt"):
                if f.stem not in ("fp32", "step"):
                    state[f.stem] = _full(f).view_as(hp).to(device=hp.device, dtype=hp.dtype).clone()
            step = _saved_step(folder)
            if step is not None:
                state["step"] = _step_like(base, step, hp.device)
        saved_group = common["param_groups"][g] if g < len(common.get("param_groups", [])) else {}
        for key, value in saved_group.items():
            if key in base.param_groups[g] and key != "params":
                base.param_groups[g][key] = value


def _load_resharded(engine, zero_dir: Path) -> None:
    """ZeRO-3: write full per-parameter fp32 weights and every optimizer state the checkpoint holds (DeepSpeed's
    universal layout, zero/<name>/{fp32,<key>...,step}.pt) into this rank's partitions and working shards."""
    opt = engine.optimizer
    if not hasattr(opt, "_get_fp32_opt_state_partition"):
        raise CheckpointError(f"resharding into a {type(opt).__name__} optimizer is not supported")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    # The optimizer creates its state at the first step; a resumed engine has not stepped yet: create each
    # sub-group's flat state for the keys its parameters saved, and its step count.
    for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
        folders = [zero_dir / names[id(p)] for p in opt.fp16_groups[i] if id(p) in names]
        keys = set().union(*(_saved_keys(f) for f in folders)) - {"step"}
        state = opt.optimizer.state[flat]
        for key in sorted(keys):
            if key not in state or state[key].numel() != flat.numel():
                state[key] = torch.zeros_like(flat)
        step = next((s for s in map(_saved_step, folders) if s is not None), None)
        if step is not None:
            state["step"] = _step_like(opt.optimizer, step, flat.device)
    for name, p in engine.module.named_parameters():
        folder = zero_dir / name
        if not (folder / "fp32.pt").exists():
            raise CheckpointError(f"universal checkpoint {zero_dir} has no state for parameter {name}")
        rank = opt._get_param_partition_rank(p)
        for f in sorted(folder.glob("*.pt")):
            key = f.stem
            if key == "step" or (key != "fp32" and not p.requires_grad):
                continue
            value = _full(f).flatten()
            if key == "fp32":
                _copy_slice(p.ds_tensor.data, value, rank)
                if not p.requires_grad:
                    continue
            # This rank holds elements [rank*part, (rank+1)*part) of the zero-padded flat parameter.
            part, _ = opt._get_fp32_opt_state_partition(
                p, release_swap_buffers=False, optim_state_key=None if key == "fp32" else key
            )
            _copy_slice(part.data, value, rank)


def restored_summary(engine) -> dict[str, Any]:
    """What the engine holds right after a load, as the next step reads it (no collective: this rank's part):
    the optimizer's state keys per group, its step counts, every group's lr, the fp16 loss scale, the scheduler
    and its position."""
    opt = engine.optimizer
    base = _inner(opt)
    # Each group's flat state tensors: ZeRO-3 puts a sub-group's flat partition into its group only while it
    # steps it (sub_group_to_group_id says whose it is); ZeRO-0-2 keep them in the group.
    flats: list[list] = [list(g["params"]) for g in base.param_groups]
    if hasattr(opt, "fp32_partitioned_groups_flat") and hasattr(opt, "sub_group_to_group_id"):
        flats = [[] for _ in base.param_groups]
        for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
            flats[opt.sub_group_to_group_id[i]].append(flat)
    keys, steps = [], set()
    for params in flats:
        held: set[str] = set()
        for p in params:
            st = base.state.get(p, {})
            held |= set(st)
            if "step" in st:
                steps.add(int(float(st["step"])))
        keys.append(sorted(held))
    scaler = getattr(opt, "loss_scaler", None)
    sched = engine.lr_scheduler
    position = getattr(sched, "last_batch_iteration", getattr(sched, "last_epoch", None))
    precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
    return {
        "stage": int(engine.zero_optimization_stage()),
        "precision": precision,
        "state_keys": keys,
        "steps": sorted(steps),
        "lr": [float(g["lr"]) for g in opt.param_groups],
        "loss_scale": float(scaler.cur_scale) if engine.fp16_enabled() and scaler is not None else None,
        "scheduler": None if sched is None else (type(sched).__name__, position),
    }


def _copy_slice(dst: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    n = dst.numel()
    start = n * rank
    take = max(0, min(n, full.numel() - start))
    flat = dst.view(-1)
    flat.zero_()
    if take:
        flat[:take].copy_(full[start : start + take].to(flat.dtype))
