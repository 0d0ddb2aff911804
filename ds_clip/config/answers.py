"""open_clip_train's flags that ds_clip has no field for, each answered with one line (exit 2).

`ds_clip.config.parser.build_parser` adds them to the command line, so argparse never says "unrecognized
arguments" to an open_clip user; docs/configuration.md lists them.
"""

from __future__ import annotations

import argparse

from ds_clip.errors import SettingsError

# open_clip_train's flags that ds_clip has no field for: each is parsed (so argparse never says "unrecognized
# arguments") and answered with one line, exit 2: why ds_clip has no such thing and what to use instead.
# option -> (takes a value?, the answer). With the settings fields this covers every option of open_clip_train
# 3.3.0's parser (tests/test_open_clip_flags.py walks that parser).
ANSWERED: dict[str, tuple[bool, str]] = {
    "--torchscript": (
        False,
        "DeepSpeed trains the eager module, which torch.jit.script would replace: use --torchcompile (or "
        "script the exported model, ds-clip-export)",
    ),
    "--trace": (
        False,
        "torch.jit.trace is for inference and ds_clip trains: trace the exported model (ds-clip-export) instead",
    ),
    "--device": (
        True,
        "DeepSpeed picks the accelerator (CUDA when there is one, else the CPU; DS_ACCELERATOR=cpu forces the "
        "CPU) and the launcher the device of each rank: drop it",
    ),
    "--dist-url": (
        True,
        "the launcher sets the rendezvous (deepspeed, torchrun, mpirun or srun: MASTER_ADDR/MASTER_PORT): drop "
        "it; see scripts/launch_*.sh",
    ),
    "--dist-backend": (
        True,
        "DeepSpeed picks the backend from the accelerator (nccl on CUDA, gloo on the CPU): drop it",
    ),
    "--horovod": (
        False,
        "ds_clip runs on DeepSpeed, not Horovod: launch with deepspeed, torchrun, mpirun or srun "
        "(scripts/launch_*.sh)",
    ),
    "--ddp-static-graph": (
        False,
        "there is no DDP wrapper: DeepSpeed's engine reduces the gradients, once per optimizer step (see "
        "--coalesce-grad-reduction): drop it",
    ),
    "--no-set-device-rank": (
        False,
        "DeepSpeed sets each rank's device from LOCAL_RANK; with one GPU per process set CUDA_VISIBLE_DEVICES "
        "and launch with --num_gpus 1 per process: drop it",
    ),
    "--copy-codebase": (
        False,
        "ds_clip runs the installed package; the run folder keeps settings.json and ds_config.json to "
        "reproduce a run: drop it",
    ),
    "--use-bnb-linear": (
        True,
        "bitsandbytes int8 linear layers are not trained by ds_clip (DeepSpeed's precisions: --precision "
        "fp32, bf16, fp16): drop it",
    ),
    "--loss-dist-impl": (
        True,
        "ds_clip's loss gathers once per step; choose its layout with --local-loss --gather-with-grad and "
        "--loss-impl dense|tiled|auto instead",
    ),
}


def answer(option: str) -> str:
    """The one line an answered open_clip flag gets (exit 2)."""
    return f"{option} is open_clip_train's flag: {ANSWERED[option][1]}"


class Answered(argparse.Action):
    """Parses an answered open_clip flag (with or without its value) and stops with its answer."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise SettingsError(answer(self.option_strings[0]))
