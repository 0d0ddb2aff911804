"""The wheel is enough to train: built from the checkout, installed non-editable into a fresh environment,
run from a folder outside the repository, every shipped DeepSpeed preset trains 2 steps. The wheel holds ds_clip
alone: the test harness beside it (ds_clip_harness) stays in the checkout and is not importable there.

This pins the bug where `ds_config.PRESET_DIR` pointed at ds_configs/ beside the package: an editable
checkout has it, a wheel did not, and no preset (not even the default) loaded. The presets live once in
git, in the top-level ds_configs/; the symlink ds_clip/ds_configs makes setuptools pack them as package
data.

Installing torch, DeepSpeed and open_clip again would cost gigabytes, so the fresh environment borrows
them: a `.pth` file in its site-packages holds the path of the test venv's site-packages. A plain path
line only adds that folder to sys.path; the `.pth` files inside it (among them the editable-install
finder that maps `ds_clip` to this checkout) are not processed, so the fresh environment cannot import
the checkout's ds_clip. The test checks that before installing the wheel.

Commands run as a user would: `FRESH/bin/ds-clip-train` with cwd outside the repo. The per-preset runs
share one process (`ds_clip.train.main(argv)` in a loop; each run builds its own engine) because every
DeepSpeed start costs seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from ds_clip_harness.models import E2E_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SHIPPED_PRESETS = sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
SHIPPED_RECIPES = sorted(p.stem for p in (ROOT / "ds_clip" / "recipes").glob("*.json"))

# One training, as small as the CLI allows: m=4 pairs, k=2, 2 optimizer steps, one process.
TRAIN_ARGS = ["--batch-size", "4", "--accum-freq", "2", "--max-steps", "2", "--warmup", "1",
              "--log-every-n-steps", "1", "--workers", "0", "--train-num-samples", "64",
              "--report-to", "csv"]  # fmt: skip

# Runs in the fresh environment: every preset named on the command line, one process, one line of JSON
# per run. Nothing from the repository is importable there, so this is all inline.
DRIVER = """
import json, sys
from ds_clip.train import main
model, logs, presets = sys.argv[1], sys.argv[2], sys.argv[3:]
train_args = json.loads(sys.stdin.read())
for preset in presets:
    rc = main(["--model", model, "--logs", logs, "--name", preset, "--ds-config", preset, *train_args])
    print("RESULT " + json.dumps({"preset": preset, "rc": rc}), flush=True)
"""


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def _env(fresh: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # FRESH/bin first; the test venv's bin after it only for tools the JIT op builds call (ninja).
    env["PATH"] = os.pathsep.join([str(fresh / "bin"), str(VENV_BIN), env.get("PATH", "")])
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(VENV_BIN.parent / "torch_extensions"))
    return env


def _run(cmd: list, cwd: Path, env: dict[str, str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def _checkout_copy(dest: Path) -> Path:
    """The files a fresh clone would have (tracked, plus new files not ignored), symlinks kept as links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if not os.path.lexists(src):  # deleted in the working tree, not yet committed
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        elif src.is_file():
            shutil.copy2(src, target)
    return dest


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    """Build the wheel from a copy of the checkout, make a fresh venv, install the wheel into it."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _checkout_copy(tmp / "src")
    dist = tmp / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", dist, src],
        cwd=tmp, env=dict(os.environ),
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("ds_clip-*.whl")

    venv = tmp / "fresh"
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp, env=dict(os.environ))
    assert made.returncode == 0, made.stderr
    env = _env(venv)
    where = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 cwd=tmp, env=env)  # fmt: skip
    site = Path(where.stdout.strip())
    heavy = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "ds_clip_test_heavy_deps.pth").write_text("".join(f"{p}\n" for p in heavy))

    # The checkout's ds_clip must be invisible before the wheel is installed (editable finder not loaded).
    before = _run([venv / "bin" / "python", "-c", "import ds_clip"],
                  cwd=tmp, env=env)  # fmt: skip
    assert before.returncode != 0 and "No module named 'ds_clip'" in before.stderr, before.stderr[-2000:]

    # pip itself comes from the borrowed site-packages; it installs into sys.prefix, i.e. FRESH.
    # --ignore-installed: never look at (or uninstall) the test venv's editable ds_clip.
    installed = _run(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
         "--disable-pip-version-check", wheel],
        cwd=tmp, env=env,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    model = tmp / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    work = tmp / "elsewhere"  # cwd of every run: outside the repository, no ds_configs/ beside it
    work.mkdir()
    return {"venv": venv, "wheel": wheel, "env": env, "model": f"local-dir:{model}", "cwd": work}


def test_wheel_holds_the_package_and_presets_but_no_tools(fresh):
    names = zipfile.ZipFile(fresh["wheel"]).namelist()
    assert sorted(
        n[len("ds_clip/ds_configs/") : -5] for n in names if n.startswith("ds_clip/ds_configs/")
    ) == (SHIPPED_PRESETS)
    # --recipe NAME reads the recipes beside the presets, inside the installed package.
    recipes = sorted(n[len("ds_clip/recipes/") : -5] for n in names if n.startswith("ds_clip/recipes/"))
    assert recipes == SHIPPED_RECIPES and "datacomp-medium" in recipes
    assert {"ds_clip/train.py", "ds_clip/model_configs/ds-clip-tiny.json"} <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "tests", "scripts", "ds_configs")]
    assert "ds_clip/bench.py" not in names
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    # The test harness (ds_clip_harness, beside the package) stays out: the wheel is ds_clip and its metadata.
    assert {n.split("/")[0] for n in names} == {"ds_clip", meta.split("/")[0]}, sorted(names)
    assert not [n for n in names if "harness" in n or n.endswith("/testing.py")]
    requires = [ln for ln in zipfile.ZipFile(fresh["wheel"]).read(meta).decode().splitlines()
                if ln.startswith("Requires-Dist:")]  # fmt: skip
    runtime = [ln for ln in requires if "extra ==" not in ln]
    assert runtime and not [ln for ln in runtime if "pandas" in ln], runtime  # pandas: bench extra only
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(fresh["wheel"]).read(entry).decode()
    assert "ds-clip-train = ds_clip.train:main" in scripts and "ds-clip-bench" not in scripts


def test_installed_package_is_the_wheel_not_the_checkout(fresh):
    probe = (
        "import importlib.util, json, sys, ds_clip\n"
        "from ds_clip.ds_config import PRESET_DIR, list_presets, load_preset\n"
        "print(json.dumps({'file': ds_clip.__file__, 'presets_dir': str(PRESET_DIR), 'presets': list_presets(),"
        " 'stage': load_preset('zero3_bf16')['zero_optimization']['stage'],"
        " 'finders': [type(f).__module__ + '.' + type(f).__qualname__ for f in sys.meta_path],"
        " 'harness': importlib.util.find_spec('ds_clip_harness') is not None}))"
    )
    proc = _run([fresh["venv"] / "bin" / "python", "-c", probe], cwd=fresh["cwd"], env=fresh["env"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = str(fresh["venv"].resolve())
    assert info["file"].startswith(venv) and not info["file"].startswith(str(ROOT)), info
    assert info["presets_dir"].startswith(venv) and Path(info["presets_dir"]).is_dir(), info
    assert not Path(info["presets_dir"]).is_symlink()  # real files in the install, not a link to the repo
    assert info["presets"] == SHIPPED_PRESETS and info["stage"] == 3
    assert not [f for f in info["finders"] if "editable" in f.lower()], info["finders"]
    assert info["harness"] is False  # trains (the tests below) with no test harness installed


def test_console_script_help_and_default_preset_train(fresh):
    bin_dir = fresh["venv"] / "bin"
    helped = _run([bin_dir / "ds-clip-train", "--help"], cwd=fresh["cwd"], env=fresh["env"])
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--accum-freq" in helped.stdout and "--ds-config" in helped.stdout
    assert not (bin_dir / "ds-clip-bench").exists()

    # No --ds-config, one process: the default preset (zero0_fp32 alone and in fp32 on up to 4 ranks; the
    # wheel once lacked it).
    logs = fresh["cwd"] / "logs"
    proc = _run([bin_dir / "ds-clip-train", "--model", fresh["model"], "--logs", logs, "--name", "default",
                 *TRAIN_ARGS], cwd=fresh["cwd"], env=fresh["env"])  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    _check_run(logs / "default", "zero0_fp32")


def _check_run(run_dir: Path, preset: str) -> None:
    ds = json.loads((run_dir / "ds_config.json").read_text())
    stage = int(preset[len("zero")])
    assert ds["zero_optimization"]["stage"] == stage, (preset, ds)
    assert ds.get("bf16", {}).get("enabled", False) == ("bf16" in preset), (preset, ds)
    assert ds.get("fp16", {}).get("enabled", False) == ("fp16" in preset), (preset, ds)
    offload = ds["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    assert (offload == "cpu") == ("offload" in preset), (preset, ds)
    assert json.loads((run_dir / "settings.json").read_text())["ds_config"] in (preset, None)
    rows = (run_dir / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2, rows  # header + one row per optimizer step


def _train_presets(fresh: dict, presets: list[str], logs: Path) -> None:
    proc = _run([fresh["venv"] / "bin" / "python", "-c", DRIVER, fresh["model"], logs, *presets],
                cwd=fresh["cwd"], env=fresh["env"], timeout=600, input=json.dumps(TRAIN_ARGS))  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    results = [
        json.loads(ln[len("RESULT ") :]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")
    ]
    assert results == [{"preset": p, "rc": 0} for p in presets], out[-4000:]
    for p in presets:
        _check_run(logs / p, p)


def test_every_shipped_preset_trains_from_the_wheel(fresh):
    """ZeRO 0-3 x fp32/bf16 and the CPU-offload presets (fp16: the next test)."""
    presets = [p for p in SHIPPED_PRESETS if "fp16" not in p]
    assert {"zero0_fp32", "zero3_bf16", "zero2_offload_fp32", "zero3_offload_bf16"} <= set(presets)
    _train_presets(fresh, presets, fresh["cwd"] / "presets")


def test_fp16_presets_train_from_the_wheel(fresh):
    presets = [p for p in SHIPPED_PRESETS if "fp16" in p]
    assert presets
    if not _fp16_supported():
        pytest.skip("this device has no fp16 support in DeepSpeed (a CPU without AVX512-FP16)")
    _train_presets(fresh, presets, fresh["cwd"] / "presets_fp16")
