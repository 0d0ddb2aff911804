"""The real CLI under the real launchers (deepspeed, mpirun), and its answers to bad input."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_clip import shm
from ds_clip_harness.models import COCA_E2E_MODEL, E2E_MODEL, E2E_TEACHER, write_pretrained_dir
from tests import launch, shm_files

M, K, W, STEPS = 4, 2, 2, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("e2e_model")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


def _run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return launch.run(cmd, timeout=timeout)


def _train_args(model: str, logs: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(K), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--logs", str(logs), "--name", name, "--workers", "1",
        "--report-to", "csv,tensorboard", "--warmup", "1", *extra,
    ]  # fmt: skip


def _check_run(proc: subprocess.CompletedProcess, run_dir: Path, steps: int = STEPS, first: int = 1) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # samples seen count k*m*W pairs per optimizer step
    seen = [int(x) for x in re.findall(r"^step \d+/\d+ \| epoch \d+ \| samples (\d+)", proc.stdout, re.M)]
    assert seen == [s * K * M * W for s in range(first, steps + 1)], out[-3000:]
    assert "world size 2" in out
    settings = json.loads((run_dir / "settings.json").read_text())
    assert settings["accum_freq"] == K and settings["batch_size"] == M
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["gradient_accumulation_steps"] == 1
    assert ds["train_micro_batch_size_per_gpu"] == M
    assert ds["train_batch_size"] == M * W
    assert ds["managed_gradient_accumulation"] is False
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["samples_seen"]) for r in rows][-1] == steps * K * M * W
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "latest_complete").read_text() == f"step_{steps:08d}"


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_launcher_trains_and_resumes(model_dir, tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --accum-freq 2` trains, logs k*m*W samples per
    step, writes the resolved configs and a complete checkpoint; `--resume latest` continues at the
    saved step instead of starting over, here with --ema-decay turned on (the average starts from the resumed
    weights; ds-clip-export --ema writes it). (--torchcompile under the launcher: tests/test_compile.py.)

    Nothing left in /dev/shm: neither run leaves a DeepSpeed CPU shm buffer of its own, and
    the first one's start removes a stale buffer (its owner process is dead) and says so, while a buffer
    a live process maps stays (in a /dev/shm of its own as root: tests/shm_files.run_beside_planted)."""
    ports: list[int] = []
    while len(ports) < 4:  # two launches, and the ports named by the planted buffers
        ports += [q for q in [launch.free_port()] if q not in ports]
    args = _train_args(model_dir, tmp_path, "ds")
    proc = _run(
        shm_files.run_beside_planted(launch.deepspeed(*args, port=ports[0]), ports[0], ports[2], ports[3])
    )
    _check_run(proc, tmp_path / "ds")
    seen = shm_files.beside_planted_report(proc.stdout)
    assert not seen["stale"] and seen["live"] and seen["left"] == [], seen
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ds_clip.shm: removed" in ln]
    stale = shm.buffer_name(0, addr="127.0.0.1", port=str(ports[2]))
    assert len(said) == 1 and stale in said[0], said
    # The resume turns the weight EMA on: the checkpoint has none, so it starts from the resumed weights and says
    # so once; the next checkpoint holds one file of it per rank, and ds-clip-export --ema writes it.
    more = _train_args(model_dir, tmp_path, "ds", "--ema-decay", "0.9", steps=STEPS + 2)
    proc = _run(launch.deepspeed(*more, "--resume", "latest", port=ports[1]))
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "at step 4" in out
    assert out.count("was saved without a weight EMA; the average starts from its weights") == 1, out[-3000:]
    _check_run(proc, tmp_path / "ds", steps=STEPS + 2, first=STEPS + 1)
    assert shm_files.left_by(ports[1]) == []
    last = tmp_path / "ds" / "checkpoints" / f"step_{STEPS + 2:08d}"
    assert sorted(f.name for f in last.glob("ema_rank*.pt")) == ["ema_rank0.pt", "ema_rank1.pt"]
    export = _run(
        [sys.executable, "-m", "ds_clip.export", str(tmp_path / "ds"), str(tmp_path / "ema"), "--ema"]
    )
    assert export.returncode == 0 and (tmp_path / "ema" / "open_clip_model.safetensors").is_file(), (
        export.stderr
    )


@pytest.fixture(scope="module")
def coca_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("e2e_coca")
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": COCA_E2E_MODEL, "preprocess_cfg": {}}))
    return f"local-dir:{d}"


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_launcher_trains_coca_decoder(coca_dir, tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --model local-dir:<tiny CoCa> --accum-freq 4` trains both
    CoCa terms: the run succeeds, logs k*m*W samples per step, and every text_decoder tensor of the exported model moved from its initialisation (a decoder left untrained would show here).
    A CoCa with --siglip (an objective whose decoder would not train) is refused with exit 2 at the first step,
    naming --model and the decoder's outputs."""
    from safetensors.torch import load_file

    from ds_clip.export.openclip import export
    from ds_clip.models.model import build_model

    k, steps = 4, 2
    args = [
        "--model", coca_dir, "--batch-size", str(M), "--accum-freq", str(k), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--logs", str(tmp_path), "--name", "coca", "--workers", "1", "--warmup", "1",
    ]  # fmt: skip
    proc = _run(launch.deepspeed(*args))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    seen = [int(x) for x in re.findall(r"^step \d+/\d+ \| epoch \d+ \| samples (\d+)", proc.stdout, re.M)]
    assert seen == [s * k * M * W for s in range(1, steps + 1)], out[-3000:]
    exported = export(str(tmp_path / "coca"), tmp_path / "export")
    trained = load_file(str(exported / "open_clip_model.safetensors"))
    init = build_model(coca_dir, seed=0).model.state_dict()
    decoder = [key for key in trained if key.startswith("text_decoder.")]
    assert decoder
    unmoved = [key for key in decoder if torch.equal(trained[key], init[key].reshape(trained[key].shape))]
    assert not unmoved, unmoved

    bad = _bad("--model", coca_dir, "--siglip", "--logs", str(tmp_path), "--name", "bad", "--max-steps", "1",
               "--workers", "0", "--batch-size", "2")  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    assert f"--model {coca_dir}" in bad.stderr and "'logits'" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.e2e
@pytest.mark.slow
def test_deepspeed_launcher_trains_distilled_with_accum_freq_4(model_dir, tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --distill-model local-dir:TEACHER --accum-freq 4` (what
    open_clip refuses: its distillation asserts --accum-freq 1) trains: k*m*W = 16 samples per step, the
    teacher recorded in the run's settings, a complete checkpoint of the student."""
    teacher = write_pretrained_dir(tmp_path / "teacher", E2E_TEACHER)
    m, k, steps = 2, 4, 2
    args = [
        "--model", model_dir, "--batch-size", str(m), "--accum-freq", str(k), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--logs", str(tmp_path), "--name", "distill", "--workers", "1",
        "--warmup", "1", "--distill-model", teacher,
    ]  # fmt: skip
    proc = _run(launch.deepspeed(*args))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    seen = [int(x) for x in re.findall(r"^step \d+/\d+ \| epoch \d+ \| samples (\d+)", proc.stdout, re.M)]
    assert seen == [s * k * m * W for s in range(1, steps + 1)], out[-3000:]
    run_dir = tmp_path / "distill"
    assert json.loads((run_dir / "settings.json").read_text())["distill_model"] == teacher
    assert (run_dir / "checkpoints" / "latest_complete").read_text() == f"step_{steps:08d}"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="Open MPI is not installed (scripts/setup.sh installs it)"
)
def test_mpirun_trains_on_webdataset_shards(model_dir, tmp_path):
    """`ds-clip-shards` writes shards; `mpirun -np 2 python -m ds_clip.train --train-data ...
    --accum-freq 2` trains on them (ranks found through mpi4py, exact-epoch webdataset split)."""
    shards = tmp_path / "shards"
    made = _run([sys.executable, "-m", "ds_clip.shards", "--synthetic", "96", "--image-size", "32",
                 "--samples-per-shard", "16", "--output", str(shards)])  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "96" in made.stdout
    args = _train_args(model_dir, tmp_path, "mpi", "--train-data", str(shards / "{00000..00005}.tar"))
    cmd = ["mpirun", "-np", "2", "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [
        "-x",
        "PATH",
        "-x",
        "PYTHONPATH",
        "-x",
        "OMP_NUM_THREADS",
        sys.executable,
        "-m",
        "ds_clip.train",
        *args,
    ]
    _check_run(_run(cmd), tmp_path / "mpi")


def _bad(*args: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "ds_clip.train", *args], timeout=120)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--accum-freq", "0"], "--accum-freq"),
        (["--batch-size", "0"], "--batch-size"),
        (["--batch-size", "-3"], "--batch-size"),
        (["--model", "no-such-model"], "--model"),
        (["--ds-config", "no_such_preset"], "--ds-config"),
        (["--train-data", "/nonexistent/shard-{00000..00003}.tar"], "/nonexistent/shard-{00000..00003}.tar"),
        (["--local-loss"], "--gather-with-grad"),
        (["--precision", "fp16", "--zero-stage", "0"], "stage 0"),
        (["--ema-decay", "1"], "--ema-decay"),
        (["--ema-warmup"], "--ema-decay"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    """Each bad input: exit status 2, one line on stderr naming the flag, no traceback."""
    proc = _bad(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err


def test_conflicting_json_names_key_and_flag(tmp_path):
    """A user's JSON whose block contradicts a flag the user passed, or whose batch divides on no world size, is
    refused in one line naming the key (and the flag); a value the flag merely leaves at its default is not."""
    cfg = tmp_path / "mine.json"
    cfg.write_text(
        json.dumps({"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupLR", "params": {}}})
    )
    proc = _bad("--ds-config", str(cfg), "--lr-scheduler", "const")
    assert proc.returncode == 2
    assert 'scheduler.type="WarmupLR"' in proc.stderr and "--lr-scheduler const" in proc.stderr
    cfg.write_text(json.dumps({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}))
    proc = _bad("--ds-config", str(cfg))
    assert proc.returncode == 2
    assert "train_batch_size=6" in proc.stderr and "train_micro_batch_size_per_gpu=4" in proc.stderr


def test_text_tower_smaller_than_its_tokenizer_is_exit_2(tmp_path):
    """A local-dir: model whose text_cfg.vocab_size is below its tokenizer's ids (open_clip's 49408) is
    refused by name before the first step, instead of an index error inside the embedding (or a compiled
    kernel's out-of-bounds abort under --torchcompile)."""
    from ds_clip_harness.models import CONFIGS

    (tmp_path / "small_vocab").mkdir()
    (tmp_path / "small_vocab" / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": CONFIGS["vit"], "preprocess_cfg": {}})
    )
    model = f"local-dir:{tmp_path / 'small_vocab'}"
    proc = _bad("--model", model, "--logs", str(tmp_path / "logs"), "--max-steps", "1", "--workers", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "64 token embeddings" in proc.stderr and "text_cfg.vocab_size" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args", [["--batch-size", "0"], ["--no-such-flag"], ["--help"]])
def test_only_rank_0_speaks_about_the_command_line(args):
    """Every rank parses the same command line: a bad flag (ds_clip's check or argparse's), or --help, is
    printed by rank 0 only (RANK as deepspeed and torchrun set it, OMPI_COMM_WORLD_RANK as mpirun, SLURM_PROCID
    as srun), so a job shows it once. Every rank exits with the same status. The six processes run at once, as a
    job's ranks do (a quiet rank waits out its grace before it exits)."""
    started = [
        (var, rank, quiet, launch.start([sys.executable, "-m", "ds_clip.train", *args],
                                        env=launch.environment(**{var: rank})))
        for var in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
        for rank, quiet in (("0", False), ("1", True))
    ]  # fmt: skip
    for var, rank, quiet, proc in started:
        p = launch.finish(proc, timeout=120)
        assert p.returncode == (0 if args == ["--help"] else 2), p.stderr[-2000:]
        assert "Traceback" not in p.stderr
        said = (p.stdout + p.stderr).strip()
        assert (said == "") == quiet, (var, rank, said[-2000:])


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu" or get_accelerator().is_fp16_supported()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(_fp16_supported(), reason="this machine's accelerator runs fp16")
def test_fp16_on_a_cpu_without_it_is_one_line_once_per_job(model_dir, tmp_path):
    """`--precision amp` (DeepSpeed fp16) under `deepspeed --num_gpus 2` on a CPU without AVX512-FP16: one
    `ds-clip-train: error:` line for the whole job, naming --precision and what to use instead, exit 2, no
    traceback (DeepSpeed's own `ValueError` traceback came from every rank). DeepSpeed's launch.py still adds
    its own line naming the rank's command and status 2 (docs/faults.md)."""
    args = _train_args(model_dir, tmp_path, "fp16", "--precision", "amp")
    p = _run(launch.deepspeed(*args))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-4000:]
    errors = [line for line in out.splitlines() if "ds-clip-train: error:" in line]
    assert len(errors) == 1 and "--precision amp" in errors[0] and "amp_bf16" in errors[0], out[-4000:]
    assert "Traceback" not in out
