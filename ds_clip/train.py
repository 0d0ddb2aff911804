"""ds-clip-train: CLIP/SigLIP training on DeepSpeed with exact cached-feature accumulation.

deepspeed --num_gpus 2 --module ds_clip.train --accum-freq 4 --batch-size 16
torchrun --nproc_per_node 2 -m ds_clip.train --accum-freq 4
mpirun -np 2 --bind-to none python -m ds_clip.train --accum-freq 4
srun python -m ds_clip.train ...          (see scripts/launch_slurm.sbatch)
ds-clip-train --max-steps 10              (one process, no launcher)
ds-clip-train --dry-run ...               (check the flags, print the settings and the DeepSpeed JSON, exit)
WORLD_SIZE=8 ds-clip-train --dry-run --recipe datacomp-medium   (the k that N = 4096 derives on 8 ranks)
torchrun --nnodes 1:2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --nproc_per_node 4 \
    -m ds_clip.train --global-batch-size 4096 --name RUN --resume latest --save-every-n-steps 500
                                          (elastic: the same command for the first start and every restart)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ds_clip.config import TrainSettings, parse_settings, settings_to_dict
from ds_clip.errors import RunError, UserError


def main(argv: list[str] | None = None) -> int:
    # Every rank parses the same command line: only rank 0 shows what argparse says about it (an error,
    # --help), so a bad flag reads once per job, not once per rank.
    quiet = _launcher_rank() != 0
    try:
        with _silenced(quiet):
            settings = parse_settings(argv)
    except UserError as exc:
        return _refused(exc, quiet, 2)
    except SystemExit as exc:
        # argparse's own exit: a mistyped flag (its one-line error, printed by rank 0 alone) or --help. It must
        # pass through the same grace as every other refusal: a quiet rank that exits at once lets the launcher
        # end the job before rank 0 has written the line (exit 2 and nothing printed).
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if code and quiet:
            time.sleep(QUIET_EXIT_GRACE_S)
        return code
    if settings.dist.dry_run:
        try:
            dry_run(settings)
        except UserError as exc:
            return _refused(exc, quiet, 2)
        return 0
    # Heavy imports (torch, deepspeed, open_clip) only after the settings are known to be good.
    import torch.distributed as dist

    from ds_clip.training.trainer import train

    try:
        train(settings)
    except UserError as exc:  # -> 2 (ds_clip/errors.py)
        return _refused(exc, quiet and exc.same_on_every_rank, exc.exit_code)
    except RunError as exc:  # -> 1
        _error(exc, False)
        return exc.exit_code
    except KeyboardInterrupt:
        # Ctrl-C before the loop's stop handler was installed (start-up): nothing was trained yet.
        _error("interrupted during start-up (SIGINT); nothing was trained or saved", quiet)
        return 130
    except (dist.DistError, RuntimeError) as exc:
        # A collective that failed: the peer closed the connection (a rank died) or --dist-timeout passed.
        if not isinstance(exc, dist.DistError) and not _looks_like_lost_peer(str(exc)):
            raise
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        _error(
            f"lost contact with another rank ({first}): a rank died, the network failed or --dist-timeout "
            "passed; relaunch with --resume latest to continue from the last complete checkpoint",
            False,
        )
        return 1
    return 0


def _launcher_rank() -> int:
    """This process's global rank as its launcher set it (deepspeed and torchrun: RANK; mpirun: OMPI_*/PMI_RANK;
    srun: SLURM_PROCID), read before any process group exists; 0 for one process."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    if not quiet:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# How long a rank that does not report a refusal every rank meets waits before it exits. The launchers end the
# whole job when the first rank exits with an error: a silent rank that got there first would kill rank 0 before
# rank 0 wrote the one line that says why (seen under the deepspeed launcher: exit 2, nothing on stderr).
QUIET_EXIT_GRACE_S = 5.0


def _refused(exc: BaseException, quiet: bool, code: int) -> int:
    """Report ``exc`` (rank 0 alone where ``quiet``) and return the exit status; a quiet rank first gives rank 0,
    which meets the same refusal, the time to write it."""
    _error(exc, quiet)
    if quiet:
        time.sleep(QUIET_EXIT_GRACE_S)
    return code


def _error(exc: BaseException | str, quiet: bool) -> None:
    # One write with its newline: ranks that fail together share the launcher's stderr pipe, and print()'s
    # separate write of the newline let two ranks' lines run into one.
    if not quiet:
        sys.stderr.write(f"ds-clip-train: error: {exc}\n")
        sys.stderr.flush()


def dry_run(s: TrainSettings) -> None:
    """--dry-run: what can be checked without starting is checked (the flags, the training data and the
    evaluation inputs as the start reads them, the preset, the resolved JSON for this launch's world size, whether DeepSpeed builds --opt on this machine's
    accelerator); the settings and the JSON are printed as the run folder would get them. No process group,
    no model, no files written."""
    from ds_clip.data import build_train_data
    from ds_clip.ds_config.presets import precision_mapping_text, preset_label
    from ds_clip.ds_config.resolve import (
        derived_k_text,
        fill_start_keys,
        format_sources,
        json_schedule_warning,
    )
    from ds_clip.evaluate import check_train_inputs
    from ds_clip.training.engine import resolve_run  # the start's resolution (no process group)
    from ds_clip.training.schedule import RunLength, warmup_warning
    from ds_clip.training.trainer import data_section

    check_train_inputs(s)  # the evaluation inputs are read as the start would read them
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    geometry, ds = resolve_run(s, world_size)
    ds.refuse_blocked()
    # The training data too, by the builder the start calls (rank 0's part): its columns, separator, image paths,
    # rows or shards for this geometry; its steps per epoch give the run's length.
    data = build_train_data(
        data_section(s.data, image_px=64), preprocess=_unused, tokenizer=_unused, rank=0, geometry=geometry
    )
    length = RunLength.of(s.optim, data.steps_per_epoch)
    # The JSON as the start fills it from the run's length (total_num_steps). The ZeRO buckets that come from the
    # model's width stay "auto" here, the table naming what fills them: a dry run builds no model.
    cfg = ds.config
    fill_start_keys(cfg, hidden_size=0, total_steps=length.total_steps, buckets=False)
    print(f"# settings ({s.logging.logs}/{s.logging.name}/settings.json)")
    print(json.dumps(settings_to_dict(s), indent=2))
    print(f"# batch: {geometry.describe()}{derived_k_text(s, world_size)}")
    print(f"# length: {length.describe()}")
    if s.loss.siglip2:
        from ds_clip.siglip2.objective import selfsup_start_step

        start = selfsup_start_step(s.loss.siglip2_selfsup_start, length.total_steps)
        print(
            f"# --siglip2: sigmoid loss and LocCa decoder from step 1, self-distillation and masked prediction "
            f"from step {start + 1} of {length.total_steps} (--siglip2-selfsup-start {s.loss.siglip2_selfsup_start:g})"
        )
    warning = (
        json_schedule_warning(cfg, preset_label(ds.preset), length.total_steps)
        if "scheduler" in cfg
        else warmup_warning(s.optim, length.total_steps)
    )
    if warning:
        print(f"# warning: {warning}")
    if s.optim.global_batch_size is not None:
        m_from = "--batch-size" if s.chosen("batch_size") else "m"
        print(f"# k on other world sizes ({m_from} {geometry.micro_batch_size}): {_k_table(s)}")
    print(f"# --precision: DeepSpeed {s.dist.precision} ({precision_mapping_text()})")
    print(
        f"# DeepSpeed JSON for world size {world_size} on the {ds.accelerator} accelerator (ds_config.json)"
    )
    print(json.dumps(cfg, indent=2))
    print("# where each DeepSpeed key came from (flag, JSON file, auto <- what filled it, default, ds_clip)")
    print(format_sources(ds, cfg, geometry))
    for note in ds.notes:
        print(f"# {note}")
    if s.optim.optimizer == "muon":
        _print_muon_split(s)
    _print_published(s)
    print("# dry run: the flags are good; nothing was started", flush=True)


def _unused(x):
    """The transform and tokenizer of the dry run's data: it reads no image and tokenizes no caption."""
    return x


def _print_muon_split(s: TrainSettings) -> None:
    """--opt muon: which parameters DeepSpeed's Muon trains and which its AdamW (the model is built, no weights)."""
    from ds_clip.training.engine import build_model_bundle
    from ds_clip.training.optim import format_muon_split, pin_muon_tags

    bundle = build_model_bundle(s.model, seed=s.data.seed, load_published=False, loss=s.loss)
    print("# --opt muon: the towers' hidden matrices in Muon, the rest in AdamW")
    print(format_muon_split(*pin_muon_tags(bundle.model)))


def _k_table(s: TrainSettings) -> str:
    """k = N / (W*m) for the world sizes up to 1024 that divide N with this m (a restart on fewer or more ranks
    re-derives it)."""
    from ds_clip.geometry import world_sizes_for

    n, m = s.optim.global_batch_size or 0, s.optim.batch_size
    shown = [w for w in world_sizes_for(n, m) if w <= 1024]
    return ", ".join(f"W={w}: k={n // (w * m)}" for w in shown) or "none"


def _print_published(s: TrainSettings) -> None:
    """The published files the run reads (weights, configs, tokenizers) and whether each is cached: local rank 0
    of each host fetches the missing ones at start; offline (HF_HUB_OFFLINE) they must all be cached."""
    from ds_clip.checkpoint import CheckpointError
    from ds_clip.models import weights
    from ds_clip.sources import hub

    m = s.model
    try:  # where the weights come from, as the start would decide it from this machine's files
        load_weights = weights.plan_start(
            Path(s.logging.logs) / s.logging.name, s.checkpoint.resume
        ).loads_published
    except CheckpointError:
        load_weights = False  # the start refuses it in one line
    needs, command = hub.run_needs(
        m.model, m.pretrained, cache_dir=m.cache_dir, pretrained_image=m.pretrained_image,
        load_weights=load_weights, distill_model=m.distill_model,
        distill_pretrained=m.distill_pretrained,
    )  # fmt: skip
    if not needs:
        return
    mode = (
        "offline: read from the cache only"
        if hub.is_offline()
        else "fetched once per host at start if missing"
    )
    print(f"# published files ({mode}; `{command}` fills a cache)")
    for n in needs:
        print(n.describe())


def _looks_like_lost_peer(message: str) -> bool:
    m = message.lower()
    return any(
        t in m for t in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")
    )


if __name__ == "__main__":
    sys.exit(main())
