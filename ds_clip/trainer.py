"""The training loop: builds model, data and engine from settings, then owns the cadence of steps,
logging and checkpoints. The arithmetic of one step lives in ``ds_clip.step``.

Shape of a run: settings -> resolved DeepSpeed JSON -> model, data, engine -> resume -> loop -> step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_clip import checkpoint, distributed, evaluate, faults
from ds_clip.clamp import clamp_logit_scale
from ds_clip.config import TrainSettings, settings_to_dict
from ds_clip.data import DataSettings, build_train_data
from ds_clip.distributed import DistInfo, init_distributed
from ds_clip.ds_config import resolve_ds_config, write_run_files
from ds_clip.engine import build_engine, build_model_bundle
from ds_clip.metrics import MetricsWriter, peak_memory_mib
from ds_clip.preemption import StopRequest
from ds_clip.step import cached_step, micro_batch_seed

logger = logging.getLogger("ds_clip")
# A synthetic run without --train-num-samples trains this many pairs per epoch.
DEFAULT_SYNTHETIC_SAMPLES = 25_600


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with a non-finite loss or gradient."""


@dataclass
class TrainSummary:
    steps: int
    """Applied optimizer updates (what --max-steps counts)."""
    samples_seen: int
    """Pairs trained by applied updates: steps * N."""
    final_loss: float
    run_dir: Path
    skipped_steps: int = 0
    """Batches whose update was skipped (non-finite on some rank, or an fp16 overflow)."""


def _broadcast_name(name: str, info: DistInfo) -> str:
    # Every rank parses its own timestamped default name; rank 0's wins so all write one folder.
    return distributed.broadcast_object(name) if info.world_size > 1 else name


def train(s: TrainSettings) -> TrainSummary:
    # Before any process group: an unusable output folder is a one-line error, not a crash at save time.
    checkpoint.check_writable(Path(s.logs))
    info = init_distributed(timeout_s=s.dist_timeout)
    s.name = _broadcast_name(s.name, info)
    run_dir = Path(s.logs) / s.name
    ds_json = resolve_ds_config(s, info.world_size)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_files(run_dir, s, ds_json)
    # open_clip logs its model-building steps at INFO on the root logger: keep those quiet.
    logging.basicConfig(
        level=logging.WARNING, format=f"[rank{info.rank}] %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("ds_clip").setLevel(logging.INFO if info.is_main else logging.WARNING)

    bundle = build_model_bundle(s)
    model = bundle.model
    model_shapes = checkpoint.param_shapes(model)  # checked against a checkpoint before DeepSpeed loads it
    checkpoint.check_output_space(run_dir, sum(p.numel() for p in model.parameters()), s.precision)

    m, k, w = s.batch_size, s.accum_freq, info.world_size
    global_batch = w * k * m
    image_size = bundle.model_cfg["vision_cfg"].get("image_size", 224)
    image_px = image_size if isinstance(image_size, int) else image_size[0]  # open_clip allows (h, w)
    data = build_train_data(
        DataSettings(
            dataset_type=s.dataset_type,
            train_data=s.train_data,
            train_num_samples=s.train_num_samples
            or (DEFAULT_SYNTHETIC_SAMPLES if s.dataset_type == "synthetic" else None),
            dataset_resampled=s.dataset_resampled,
            image_key=s.image_key,
            caption_key=s.caption_key,
            workers=s.workers,
            seed=s.seed,
            synthetic_image_size=image_px,
        ),
        preprocess=bundle.preprocess_train,
        tokenizer=bundle.tokenizer,
        rank=info.rank,
        world_size=w,
        batch_size=m,
        accum_freq=k,
    )
    total_steps = s.max_steps or s.epochs * data.steps_per_epoch
    built = build_engine(s, bundle, rank=info.rank, world_size=w, total_steps=total_steps)
    engine, loss_fn = built.engine, built.loss_fn

    # ---- checkpoints and evaluation (issue 9): what a save records, what an evaluation needs
    import open_clip

    ckpt_meta = {
        "accum_freq": k,
        "micro_batch_size": m,
        "precision": s.precision,
        "model": s.model,
        "model_cfg": bundle.model_cfg,
        "preprocess_cfg": open_clip.get_model_preprocess_cfg(model),
    }

    def save(step: int) -> None:
        meta = {**ckpt_meta, "epoch": data.epoch, "samples_seen": step * global_batch}
        checkpoint.save(
            engine, run_dir, step, data.state_dict(), settings_to_dict(s), meta=meta, keep=s.keep_checkpoints
        )

    if s.zeroshot_classes:
        try:
            evaluate.load_zeroshot(s.zeroshot_classes)  # a bad file fails now, not after the first steps
        except evaluate.EvalError as exc:
            from ds_clip.config import SettingsError

            raise SettingsError(str(exc)) from exc
    val_settings = (
        evaluate.EvalSettings(
            val_data=s.val_data,
            val_num_samples=s.val_num_samples,
            batch_size=s.batch_size,
            zeroshot_classes=s.zeroshot_classes,
            seed=s.seed,
            image_size=image_px,
            image_key=s.image_key,
            caption_key=s.caption_key,
        )
        if s.val_data
        else None
    )

    def run_eval(step: int) -> None:
        # Every rank embeds its slice (a collective); rank 0 reports.
        metrics = evaluate.run_on_engine(
            engine, val_settings, preprocess=bundle.preprocess_val, tokenizer=bundle.tokenizer
        )
        if writer is not None:
            evaluate.report(run_dir, step, metrics, writer.tb)

    step, epoch, start_in_epoch = 0, 0, 0
    if s.resume:
        if info.is_main:
            for p in checkpoint.remove_partial(run_dir / "checkpoints"):
                logger.warning("removed partial checkpoint %s (a save that was cut short)", p)
        state = checkpoint.load(engine, run_dir, s.resume, shapes=model_shapes, global_batch=global_batch)
        step = state["step"]
        data.load_state_dict(state["data"])
        epoch, start_in_epoch = data.epoch, data.step_in_epoch
        if info.is_main:
            logger.info(
                "resumed from %s at step %d (epoch %d, step %d in epoch)%s",
                state["path"],
                step,
                epoch,
                start_in_epoch,
                " on a new world size / ZeRO stage" if state["resharded"] else "",
            )
    # ---- end of checkpoint/evaluation set-up

    if info.is_main and info.hosts is not None:
        logger.info("%s", info.hosts.describe())
    if info.is_main:
        logger.info(
            "world size %d, micro-batch m=%d, accum-freq k=%d: global batch N=W*k*m=%d pairs per optimizer "
            "step; %d steps per epoch, %d steps in total; run folder %s",
            w, m, k, global_batch, data.steps_per_epoch, total_steps, run_dir,
        )  # fmt: skip
    writer = (
        MetricsWriter(run_dir, s.report_to, total_steps, step, settings_to_dict(s)) if info.is_main else None
    )
    engine.train()
    stop = StopRequest().install()
    # Counting rule (README, "Skipped steps"): `step` counts *applied* updates. It is what --max-steps,
    # the LR schedule (DeepSpeed does not advance it on an fp16 overflow, ds_clip does not call
    # engine.step() on its own skips), checkpoint tags and samples_seen = step * N count. A skipped
    # batch is consumed (the data position moves on), counted in skipped_steps, and the next batch
    # trains the same update number.
    consecutive_skips = skipped_steps = 0
    attempts = 0  # batches taken from the loader since this process started (fault injection keys on it)
    last_loss = last_scale = None  # device tensors: read on the host only at log steps
    window_samples, window_time, window_data, window_start = 0, 0.0, 0.0, time.perf_counter()
    try:
        while step < total_steps:
            t_data = time.perf_counter()
            for batch in data.iter_epoch(epoch, start_in_epoch):
                data_time = time.perf_counter() - t_data
                t_step = time.perf_counter()
                seeds = [micro_batch_seed(s.seed, step, g) for g in batch.micro_batch_ids]
                micro_batches = batch.micro_batches
                faults.maybe_kill("kill", attempts, info.rank)
                if faults.active("nan", attempts, info.rank):
                    micro_batches = [
                        (torch.full_like(micro_batches[0][0], float("nan")), micro_batches[0][1])
                    ]
                    micro_batches += batch.micro_batches[1:]
                attempts += 1
                result = cached_step(engine, micro_batches, loss_fn, micro_batch_seeds=seeds)
                if result.skipped:
                    consecutive_skips += 1
                    skipped_steps += 1
                    if info.is_main:
                        logger.warning(
                            "step %d: %s: update skipped on every rank (%d in a row, %d in total); the "
                            "next batch trains step %d",
                            step + 1,
                            "fp16 loss-scale overflow (DeepSpeed lowers the scale)"
                            if result.overflow
                            else "non-finite loss or gradient on at least one rank",
                            consecutive_skips,
                            skipped_steps,
                            step + 1,
                        )
                    if consecutive_skips >= s.max_skipped_steps:
                        raise NonFiniteError(
                            f"{consecutive_skips} consecutive optimizer steps had a non-finite loss or gradient "
                            f"(--max-skipped-steps {s.max_skipped_steps}); stopped without saving them. The last "
                            f"complete checkpoint is kept in {run_dir / 'checkpoints'}: lower --lr or check the "
                            "data, then relaunch with --resume latest"
                        )
                else:
                    consecutive_skips = 0
                    clamp_logit_scale(engine)
                    step += 1
                    last_loss, last_scale = result.loss, result.logit_scale
                    window_samples += global_batch
                window_time += time.perf_counter() - t_step
                window_data += data_time
                if writer is not None:
                    writer.step_done()
                applied = not result.skipped
                if applied and (step % s.log_every_n_steps == 0 or step == total_steps):
                    # Samples/s counts every pair of the step: k micro-batches x m pairs x W ranks.
                    elapsed = time.perf_counter() - window_start
                    skipped = distributed.all_reduce_sum(torch.tensor(float(sum(data.skip_counts.values()))))
                    if writer is not None:
                        steps_in_window = max(1, round(window_samples / global_batch))
                        writer.log(
                            {
                                "step": step,
                                "total_steps": total_steps,
                                "epoch": epoch,
                                "samples_seen": step * global_batch,
                                "loss": float(last_loss),  # host sync: log steps only
                                "logit_scale": float(last_scale),
                                "lr": engine.get_lr()[0],
                                "samples_per_s": window_samples / elapsed,
                                "samples_per_s_per_rank": window_samples / elapsed / w,
                                "data_time_s": window_data / steps_in_window,
                                "step_time_s": window_time / steps_in_window,
                                "peak_mem_mib": peak_memory_mib(),
                                "skipped_samples": int(skipped),
                                "skipped_steps": skipped_steps,
                            }
                        )
                    window_samples, window_time, window_data, window_start = 0, 0.0, 0.0, time.perf_counter()
                # A skipped step changed nothing worth a checkpoint: the last one stays the last good one.
                if (
                    applied
                    and s.save_every_n_steps
                    and step % s.save_every_n_steps == 0
                    and step < total_steps
                ):
                    save(step)
                if (
                    applied
                    and val_settings
                    and s.val_every_n_steps
                    and step % s.val_every_n_steps == 0
                    and step < total_steps
                ):
                    run_eval(step)
                if step >= total_steps:
                    break
                if stop.should_stop():  # every rank, every step: they all save the same step together
                    save(step)
                    if info.is_main:
                        logger.info(
                            "received %s: saved checkpoint %s at step %d; resume with the same command plus "
                            "--resume latest --name %s",
                            stop.signal_name,
                            checkpoint.tag_for(step),
                            step,
                            s.name,
                        )
                    return TrainSummary(step, step * global_batch, _host(last_loss), run_dir, skipped_steps)
                t_data = time.perf_counter()
            else:
                epoch, start_in_epoch = epoch + 1, 0
                continue
            break
        if val_settings:
            run_eval(step)
        save(step)
    finally:
        stop.uninstall()
        if writer is not None:
            writer.close()
    final_loss = _host(last_loss)
    if info.is_main:
        logger.info(
            "done: %d steps, %d samples, %d skipped, final loss %.4f, run folder %s",
            step,
            step * global_batch,
            skipped_steps,
            final_loss,
            run_dir,
        )
    return TrainSummary(step, step * global_batch, final_loss, run_dir, skipped_steps)


def _host(t: torch.Tensor | None) -> float:
    return float("nan") if t is None else float(t)
