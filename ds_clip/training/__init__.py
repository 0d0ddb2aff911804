"""A run's life: from settings to a trained, saved run.

    trainer     the loop: one step, then logging, checkpoints, evaluation, each on its own cadence
    wiring      the one wiring of model, engine, loss, EMA and the step (the harness and benchmarks use it too)
    engine      the engine builder: the resolved DeepSpeed JSON, optimizer, LR schedule, loss
    optim       parameter groups (per-tower LR and weight decay, layer-wise decay, Muon's split)
    schedule    open_clip's LR schedules, in optimizer steps
    metrics     where the numbers go on rank 0 (progress, TensorBoard, CSV, W&B)
    preemption  stop requests: a signal or the launcher gone -> every rank saves the same step
    remote      checkpoints on remote storage (--remote-sync)
    faults      deterministic fault injection for the fault suite, off unless asked for

Checkpoints have their own package (ds_clip.checkpoint), as does evaluation (ds_clip.evaluate).
"""
