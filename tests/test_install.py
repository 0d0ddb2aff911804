"""ds_clip installed as a user installs it: the wheel, built from the checkout, goes into fresh virtual environments
with `pip install WHEEL`, its dependencies resolved from the package index, and runs from a folder outside the
repository. Two environments, the two ends of the supported ranges in pyproject.toml:

- newest: no constraints, no extras: what `pip install ds_clip` gives a new user today (huggingface_hub 1.x or
  later among them). Every shipped DeepSpeed preset trains here, and the hub tests (tests/test_hub.py) pass
  again with the `hub` extra's newest transformers and huggingface_hub.
- oldest: a constraints file pins each dependency to the minimum pyproject.toml declares.

In both, `ds-clip-train --version` names what was installed and two CPU ranks under the deepspeed launcher
train two steps. The wheel holds ds_clip alone: the test harness beside it (ds_clip_harness) stays in the
checkout and is not importable there.

This pins two bugs: `ds_config.PRESET_DIR` pointed at ds_configs/ beside the package (an editable checkout
has it, a wheel did not); and a start imported `huggingface_hub.utils.reset_sessions`, which huggingface_hub
1.0 removed, so every run of a fresh install failed before its first step while the project's own venv (whose
`coca` extra holds transformers, and so huggingface_hub, below 1.0) never met it.

The first install of each environment downloads what pip's cache lacks (the oldest torch is a few GB); later
runs on the same machine take it from the cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.version import Version

from ds_clip_harness.models import E2E_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
SHIPPED_PRESETS = sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json"))
SHIPPED_RECIPES = sorted(p.stem for p in (ROOT / "ds_clip" / "recipes").glob("*.json"))
SHOWN_PACKAGES = (
    "ds_clip",
    "torch",
    "deepspeed",
    "open_clip",
    "webdataset",
    "huggingface_hub",
    "transformers",
)

# The first run in a fresh environment JIT-builds DeepSpeed's CPU ops into it (a few minutes of compiling).
FIRST_RUN_S = 1200

# One training, as small as the CLI allows: m=4 pairs, k=2, 2 optimizer steps.
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


def declared_minimums() -> dict[str, str]:
    """Each runtime dependency of pyproject.toml with the lowest version it admits (every one declares one)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)(,.*)?", dep)
        assert m, (
            f"pyproject.toml: {dep!r} declares no minimum version (>=): the oldest install cannot pin it"
        )
        out[m.group(1)] = m.group(2)
    return out


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def _env(fresh: Path) -> dict[str, str]:
    """The environment of a user who activated FRESH: nothing of the test venv or the checkout on any path."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_CONSTRAINT", "TORCH_EXTENSIONS_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != VENV_BIN.resolve()]
    env["PATH"] = os.pathsep.join([str(fresh / "bin"), *path])
    env["VIRTUAL_ENV"] = str(fresh)
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    # DeepSpeed's JIT-built ops are built against this environment's torch, so they live in it.
    env["TORCH_EXTENSIONS_DIR"] = str(fresh / "torch_extensions")
    return env


def _run(cmd: list, cwd: Path, env: dict[str, str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def _checkout_copy(dest: Path, only: tuple[str, ...] = ()) -> Path:
    """The files a fresh clone would have (tracked, plus new files not ignored), symlinks kept as links;
    ``only``: just those top-level folders."""
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
        if only and rel.split("/")[0] not in only:
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        elif src.is_file():
            shutil.copy2(src, target)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout (what a clone holds)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _checkout_copy(tmp / "src")
    dist = tmp / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", dist, src],
        cwd=tmp, env=dict(os.environ),
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (whl,) = dist.glob("ds_clip-*.whl")
    return whl


def _install(tmp: Path, requirement: str, constraints: dict[str, str] | None = None) -> dict:
    """A fresh venv with ``pip install REQUIREMENT`` resolved from the index, as a user runs it."""
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", venv], cwd=tmp, env=dict(os.environ))
    assert made.returncode == 0, made.stderr
    env = _env(venv)
    # The checkout's ds_clip must be invisible before the wheel is installed.
    before = _run([venv / "bin" / "python", "-c", "import ds_clip"], cwd=tmp, env=env)
    assert before.returncode != 0 and "No module named 'ds_clip'" in before.stderr, before.stderr[-2000:]
    pins = []
    if constraints is not None:
        (tmp / "constraints.txt").write_text("".join(f"{k}=={v}\n" for k, v in constraints.items()))
        pins = ["-c", tmp / "constraints.txt"]
    installed = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", requirement, *pins],
                     cwd=tmp, env=env, timeout=1800)  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    model = tmp / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    work = tmp / "elsewhere"  # cwd of every run: outside the repository, no ds_configs/ beside it
    work.mkdir()
    return {"venv": venv, "env": env, "model": f"local-dir:{model}", "cwd": work}


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> dict:
    """newest: `pip install WHEEL`, no constraints, no extras."""
    return {**_install(tmp_path_factory.mktemp("newest"), str(wheel)), "wheel": wheel}


@pytest.fixture(scope="module")
def oldest(wheel, tmp_path_factory) -> dict:
    """oldest: every runtime dependency pinned to its declared minimum."""
    return {**_install(tmp_path_factory.mktemp("oldest"), str(wheel), declared_minimums()), "wheel": wheel}


def _versions(env: dict) -> dict[str, str]:
    """What `ds-clip-train --version` prints, as {package: version}."""
    proc = _run([env["venv"] / "bin" / "ds-clip-train", "--version"], cwd=env["cwd"], env=env["env"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(part.strip().split(" ", 1) for part in proc.stdout.strip().split(" | "))


def _pip_versions(env: dict) -> dict[str, str]:
    proc = _run([env["venv"] / "bin" / "python", "-m", "pip", "list", "--format", "json"],
                cwd=env["cwd"], env=env["env"])  # fmt: skip
    return {p["name"].lower().replace("-", "_"): p["version"] for p in json.loads(proc.stdout)}


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
                 *TRAIN_ARGS], cwd=fresh["cwd"], env=fresh["env"], timeout=FIRST_RUN_S)  # fmt: skip
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
                cwd=fresh["cwd"], env=fresh["env"], timeout=FIRST_RUN_S, input=json.dumps(TRAIN_ARGS))  # fmt: skip
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


@pytest.mark.parametrize("which", ["fresh", "oldest"])
def test_version_names_what_is_installed_and_two_ranks_train(which, request):
    """`ds-clip-train --version` prints the versions pip installed; then `deepspeed --num_gpus 2 --module
    ds_clip.train` (the environment's own launcher, from outside the repository) trains two steps on two CPU
    ranks, and the start logs the same versions once."""
    env = request.getfixturevalue(which)
    shown, installed = _versions(env), _pip_versions(env)
    assert list(shown) == [*SHOWN_PACKAGES, "python"], shown
    dists = {"open_clip": "open_clip_torch"}
    for name in SHOWN_PACKAGES:
        assert shown[name] == installed.get(dists.get(name, name), "not installed"), (name, shown, installed)
    if which == "oldest":
        for dist, low in declared_minimums().items():
            got = Version(installed[dist.lower().replace("-", "_")])
            # 2.4.0 (or 2.4.0+cpu) is the 2.4 declared
            assert Version(got.base_version) == Version(low), (dist, got, low)
    else:  # the client that removed reset_sessions: the newest install must meet it
        assert int(shown["huggingface_hub"].split(".")[0]) >= 1, shown

    logs = env["cwd"] / "logs"
    proc = _run(
        [env["venv"] / "bin" / "deepspeed", "--num_gpus", "2", "--module", "ds_clip.train", "--model", env["model"],
         "--logs", logs, "--name", "two-ranks", *TRAIN_ARGS],
        cwd=env["cwd"], env=env["env"], timeout=FIRST_RUN_S,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = (logs / "two-ranks" / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2, rows
    logged = [ln for ln in out.splitlines() if "versions: ds_clip" in ln]
    assert len(logged) == 1, logged  # once per start, by rank 0
    assert (
        f"torch {shown['torch']}" in logged[0] and f"huggingface_hub {shown['huggingface_hub']}" in logged[0]
    )


def test_hub_and_export_tests_pass_with_the_newest_transformers(fresh):
    """The `hub` and `hf` extras resolved from the index (transformers 5.x, huggingface_hub 1.x or later):
    tests/test_hub.py (published tags, hf-hub: models and hub tokenizers from a stand-in hub on 127.0.0.1, online
    and offline, under the launchers) and tests/test_hf_export.py (the transformers export loaded by transformers)
    pass against the installed wheel. Runs last in this module: it adds to `fresh`."""
    venv, env = fresh["venv"], fresh["env"]
    added = _run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{fresh['wheel']}[hub,hf]", "pytest"],
                 cwd=fresh["cwd"], env=env, timeout=1800)  # fmt: skip
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr[-3000:]
    shown = _versions(fresh)
    assert int(shown["transformers"].split(".")[0]) >= 5 and int(shown["huggingface_hub"].split(".")[0]) >= 1
    # The tests and the harness without the package: `import ds_clip` finds the wheel, in pytest and in every
    # process the tests launch (their PYTHONPATH holds this copy's root, which has no ds_clip/).
    copy = _checkout_copy(fresh["cwd"] / "suite", only=("tests", "ds_clip_harness", "pyproject.toml"))
    proc = _run([venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hub.py",
                 "tests/test_hf_export.py"], cwd=copy, env=env, timeout=1800)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", out) and " skipped" not in out, out[-3000:]
