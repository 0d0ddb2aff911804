"""ds-clip-train: CLIP/SigLIP training on DeepSpeed with exact cached-feature accumulation.

deepspeed --num_gpus 2 --module ds_clip.train --accum-freq 4 --batch-size 16
torchrun --nproc_per_node 2 -m ds_clip.train --accum-freq 4
mpirun -np 2 --bind-to none python -m ds_clip.train --accum-freq 4
srun python -m ds_clip.train ...          (see scripts/launch_slurm.sbatch)
ds-clip-train --max-steps 10              (one process, no launcher)
"""

from __future__ import annotations

import sys

from ds_clip.config import SettingsError, parse_settings


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"ds-clip-train: error: {exc}", file=sys.stderr)
        return 2
    # Heavy imports (torch, deepspeed, open_clip) only after the settings are known to be good.
    from ds_clip.checkpoint import CheckpointError
    from ds_clip.data import DataError
    from ds_clip.loss import LossConfigError
    from ds_clip.preflight import PreflightError
    from ds_clip.trainer import train

    try:
        train(settings)
    except (SettingsError, DataError, LossConfigError) as exc:
        print(f"ds-clip-train: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, PreflightError) as exc:
        print(f"ds-clip-train: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
