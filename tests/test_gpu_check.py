"""scripts/gpu_check.sh and what it runs, without a GPU.

- ``--dry-run`` lists every command of the check: the offline install from .whl/ into a folder of its own
  (``pip install --no-index --no-deps --target``), then each part under its own time limit; ``--part``
  picks parts; without wheels the script stops at once with one line saying what to run.
- benchmarks/flops.py: FLOPs from a model's shapes, known shapes -> known count.
- scripts/gpu_check_capacity.py (parts mfu and largest) runs on the CPU on a tiny model: the doubling
  searches, the FLOP arithmetic and the JSON it writes (the figures themselves need a GPU).
- scripts/gpu_check_exactness.py runs on the CPU on a tiny model, finding the harness beside the package
  (not in the wheel gpu_check.sh installs) by itself.
The offline install itself is proven by scripts/gpu_offline_proof.sh (docs/gpu.md), not in CI: it
downloads torch 2.11 for Python 3.12.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import flops

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # this venv's tools first
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _dry_run(*args: str) -> list[str]:
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [ln for ln in proc.stdout.splitlines() if ln.startswith("+ ")]


def test_gpu_check_dry_run_lists_every_command(tmp_path):
    """`bash scripts/gpu_check.sh --dry-run` prints the GPU check's commands without running any."""
    out_file = tmp_path / "gpu_check.json"
    lines = _dry_run("--out", str(out_file), "--site", str(tmp_path / "site"))
    text = "\n".join(lines)
    # install: the wheels offline into their own folder, then everything runs with PYTHONPATH=SITE:<checkout>
    assert lines[0] == "+ # part install (about 20 s)"
    pip = lines[1]
    assert re.search(
        r"timeout \d+ python3 -m pip install .*--no-index --no-deps .*--target " + str(tmp_path), pip
    )
    assert ".whl/" in pip and "setup.sh" not in text and ".venv" not in text
    assert f"+ export PYTHONPATH={tmp_path}/site:{ROOT} " in text
    helptext = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert (
        "gpu_wheelhouse.sh" in helptext.stdout
        and "--dry-run" in helptext.stdout
        and "--part" in helptext.stdout
    )
    parts = re.findall(r"^\+ # part (\S+) \(about (\d+) s\)$", text, re.M)
    assert [p for p, _ in parts] == ["install", "a", "b", "c", "mfu", "largest"]  # d only with --part d
    # The default run's own estimate stays within 10 minutes (a rerun of one part then fits 15).
    assert sum(int(s) for _, s in parts) <= 600
    # Every command but the install runs under its own time limit.
    commands = [
        ln for ln in lines if ln.startswith("+ ") and not ln.startswith(("+ #", "+ export", "+ printf"))
    ]
    limited = [ln for ln in commands if re.search(r"\btimeout \d+ ", ln)]
    assert len(limited) == len(commands) - 3, commands  # less the import check, nvidia-smi, the summary
    train = [ln for ln in lines if "ds-clip-train" in ln]
    assert len(train) == 2 and all("--nproc_per_node 1" in ln for ln in train), train
    for flag in ("--zero-stage 2", "--precision bf16", "--log-every-n-steps 1", "--val-data synthetic",
                 "--zeroshot-classes", "--save-every-n-steps"):  # fmt: skip
        assert all(flag in ln for ln in train), (flag, train)
    assert "--resume latest" in train[1] and "--resume" not in train[0]
    helpers = [ln for ln in lines if "scripts/gpu_check_collectives.py" in ln]
    assert len(helpers) == 1 and "--nproc_per_node 1" in helpers[0]
    bench = [ln for ln in lines if "benchmarks/bench_accum.py" in ln]
    assert len(bench) == 1
    for flag in ("--models ViT-B-32", "--image-size 224", "--precision bf16", "--k 1 8", "--open-clip",
                 "--device cuda"):  # fmt: skip
        assert flag in bench[0], (flag, bench)
    exact = [ln for ln in lines if "scripts/gpu_check_exactness.py" in ln]
    assert len(exact) == 1
    capacity = [ln for ln in lines if "scripts/gpu_check_capacity.py" in ln]
    assert len(capacity) == 2
    assert " mfu --model ViT-B-16 --precision bf16 --k 8 " in capacity[0]
    assert " largest --model ViT-B-16 --precision bf16 " in capacity[1] and "--budget-s 180" in capacity[1]
    assert str(out_file) in text
    assert not out_file.exists()  # nothing ran
    # Every python script it would run exists and is valid Python.
    for script in ("scripts/gpu_check_collectives.py", "scripts/gpu_check_exactness.py",
                   "scripts/gpu_check_capacity.py"):  # fmt: skip
        ast.parse((ROOT / script).read_text())


def test_gpu_check_runs_the_parts_asked_for_and_stops_without_wheels(tmp_path):
    """--part picks parts (install always first; d, --torchcompile, only when asked); no wheels: exit 2 at
    once with one line naming the folder and the script that fills it; an unknown part: exit 2."""
    lines = _dry_run("--part", "largest", "--part", "d")
    assert [ln for ln in lines if ln.startswith("+ # part")] == [
        "+ # part install (about 20 s)", "+ # part largest (about 195 s)", "+ # part d (about 150 s)",
    ]  # fmt: skip
    empty = tmp_path / "wheels"
    empty.mkdir()
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--part", "mfu", "--wheels", str(empty), "--out", str(tmp_path / "o.json")],
        cwd=ROOT, env=_env(GPU_CHECK_WORK=str(tmp_path / "work")), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"gpu_check: no wheels in {empty}: run 'bash scripts/gpu_wheelhouse.sh' where pip works, then carry "
        '.whl/ to this machine (device tool: carry [".whl"])'
    ]
    assert not (tmp_path / "work").exists()  # stopped before touching anything
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--part", "e"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown part e" in proc.stderr


# ------------------------------------------------------------------------------------------- FLOPs

# A ViT with 224 px images, 16 px patches (196 patches + the class token = 197 tokens), width 768, 12
# layers, MLP 3072; a text tower of 77 tokens, width 512, 12 layers, MLP 2048; embed dim 512 (ViT-B-16).
VIT_B_16 = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
}


def test_flops_from_shapes_known_counts():
    """Hand-counted: per block 2·L·(4w² + 2w·h) for the projections and MLP, 4·L²·w for attention."""
    patch = 2 * 196 * (3 * 16 * 16) * 768  # the patch-embedding convolution
    vit_block = 2 * 197 * (4 * 768**2 + 2 * 768 * 3072) + 4 * 197**2 * 768
    image = patch + 12 * vit_block + 2 * 768 * 512
    text_block = 2 * 77 * (4 * 512**2 + 2 * 512 * 2048) + 4 * 77**2 * 512
    text = 12 * text_block + 2 * 512 * 512
    assert flops.image_forward_flops(VIT_B_16["vision_cfg"], 512) == image == 35_126_906_880
    assert flops.text_forward_flops(VIT_B_16["text_cfg"], 512) == text == 5_959_540_736
    # ViT-B/16's published 17.5 GMACs per 224 px image (a multiply-add is 2 FLOPs).
    assert abs(image / 2e9 - 17.56) < 0.01
    pair = image + text
    assert flops.pair_forward_flops(VIT_B_16) == pair
    m, k = 256, 8
    n = m * k
    logits = 3 * 2 * n * n * 512
    # The cached step: (4k - 1)·m pair forwards (cache pass, recompute, backward = 2 forwards), the loss once.
    assert flops.cached_step_flops(VIT_B_16, m, k) == 31 * m * pair + logits
    assert flops.model_flops(VIT_B_16, m, k) == 24 * m * pair + logits
    with pytest.raises(ValueError, match="timm"):
        flops.image_forward_flops({"timm_model_name": "convnext_base", "image_size": 224}, 512)


# ------------------------------------------------------------------------- capacity script on the CPU


@pytest.mark.slow
def test_capacity_script_searches_and_reports_on_cpu(tmp_path):
    """gpu_check_capacity.py mfu + largest, one process, a tiny model on the CPU: m doubles up to
    --m-max and the timed steps run at the largest m that trained; N doubles up to --k-max with the
    tiled loss; the JSON has the FLOP counts of benchmarks/flops.py for the model's own config."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_capacity.py"), "mfu", "largest", "--allow-cpu",
         "--model", "ds-clip-tiny", "--k", "2", "--m-start", "2", "--m-max", "4", "--steps", "1",
         "--batch-size", "2", "--k-start", "2", "--k-max", "4", "--distinct", "2", "--out-dir", str(out)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    mfu = json.loads((out / "mfu.json").read_text())
    assert [t["m"] for t in mfu["search"]] == [2, 4] and all(t["ok"] for t in mfu["search"])
    assert mfu["m"] == 4 and mfu["N"] == 8 and len(mfu["step_seconds"]) == 1
    import open_clip

    import ds_clip.models.model  # noqa: F401  registers the built-in configs with open_clip

    cfg = open_clip.get_model_config("ds-clip-tiny")
    assert mfu["step_tflops_executed"] == pytest.approx(flops.cached_step_flops(cfg, 4, 2) / 1e12)
    assert mfu["utilisation_executed"] == pytest.approx(
        flops.cached_step_flops(cfg, 4, 2) / mfu["median_step_s"] / 989e12, rel=1e-3
    )  # the JSON rounds the step time to 0.1 ms
    largest = json.loads((out / "largest.json").read_text())
    assert [(t["N"], t["ok"]) for t in largest["trials"]] == [(4, True), (8, True)]
    assert largest["largest_N"] == 8 and largest["stopped_because"] == "k-max reached"
    assert "gpu_check_capacity: mfu ds-clip-tiny" in proc.stdout and "largest N ds-clip-tiny" in proc.stdout


# ----------------------------------------------------------------- exactness script on the CPU


@pytest.mark.slow
def test_exactness_script_finds_the_harness_and_runs_on_cpu(tmp_path):
    """gpu_check_exactness.py (part c) run as gpu_check.sh runs it, a script by path, here from a folder
    outside the checkout with nothing on PYTHONPATH: it finds ds_clip_harness (beside the package, not in the
    wheel) by itself, and k = 4 x m = 2 against k = 1 x m = 8 on a tiny model agree to fp32 rounding."""
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    out = tmp_path / "exactness.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_exactness.py"), "--allow-cpu", "--model",
         "ds-clip-tiny", "--micro-batch-size", "2", "--zero-stages", "0", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] and [r["zero_stage"] for r in result["runs"]] == [0]
    assert result["runs"][0]["params_compared"] > 0 and result["max_rel_err"] <= 1e-4
