"""ds_clip installed as a user installs it: the wheel, built from the checkout, goes into fresh virtual environments
with `pip install WHEEL`, its dependencies resolved from the package index, and runs from a folder outside the
repository. Two environments, the two ends of the supported ranges in pyproject.toml, one module each (so
that the disk never holds both):

- newest (this module): no constraints, no extras: what `pip install ds_clip` gives a new user today
  (huggingface_hub 1.x or later among them). Every shipped DeepSpeed preset trains here, and the hub tests
  (tests/test_hub.py) pass again with the `hub` extra's newest transformers and huggingface_hub; a transformers
  export made with 5.x loads with 4.40 (the `hf` extra's minimum, on PYTHONPATH in front) and the reverse.
- oldest (tests/test_install_oldest.py): a constraints file pins each dependency to the minimum pyproject.toml
  declares.

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
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.installs import (
    DRIVER,
    FIRST_RUN_S,
    ROOT,
    SHIPPED_PRESETS,
    SHIPPED_RECIPES,
    TRAIN_ARGS,
    build_wheel,
    check_exports_load_across_transformers,
    check_versions_and_two_ranks,
    checkout_copy,
    fp16_supported,
    installed,
    run,
    versions,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Iterator[dict]:
    """newest: `pip install WHEEL`, no constraints, no extras."""
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    with installed(tmp_path_factory.mktemp("newest"), str(wheel)) as env:
        yield {**env, "wheel": wheel}


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
    proc = run([fresh["venv"] / "bin" / "python", "-c", probe], cwd=fresh["cwd"], env=fresh["env"])
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
    helped = run([bin_dir / "ds-clip-train", "--help"], cwd=fresh["cwd"], env=fresh["env"])
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--accum-freq" in helped.stdout and "--ds-config" in helped.stdout
    assert not (bin_dir / "ds-clip-bench").exists()

    # No --ds-config, one process: the default preset (zero0_fp32 alone and in fp32 on up to 4 ranks; the
    # wheel once lacked it).
    logs = fresh["cwd"] / "logs"
    proc = run([bin_dir / "ds-clip-train", "--model", fresh["model"], "--logs", logs, "--name", "default",
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
    proc = run([fresh["venv"] / "bin" / "python", "-c", DRIVER, fresh["model"], logs, *presets],
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
    if not fp16_supported():
        pytest.skip("this device has no fp16 support in DeepSpeed (a CPU without AVX512-FP16)")
    _train_presets(fresh, presets, fresh["cwd"] / "presets_fp16")


def test_version_names_what_is_installed_and_two_ranks_train(fresh):
    check_versions_and_two_ranks(fresh, oldest=False)


def test_hub_and_export_tests_pass_with_the_newest_transformers(fresh):
    """The `hub` and `hf` extras resolved from the index (transformers 5.x, huggingface_hub 1.x or later): the
    tests that exercise those two libraries (marked `newest_clients`: each path through the hub client in
    tests/test_hub.py, with hub tokenizers from a stand-in hub on 127.0.0.1, online and offline, under the
    launcher; every test of tests/test_hf_export.py, the transformers export loaded by transformers) pass against
    the installed wheel. The rest of those modules (launch, resume and weight-source promises that no client
    version changes) run once, in the suite's own venv. Runs after the tests above: it adds to `fresh`."""
    venv, env = fresh["venv"], fresh["env"]
    added = run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{fresh['wheel']}[hub,hf]", "pytest"],
                 cwd=fresh["cwd"], env=env, timeout=1800)  # fmt: skip
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr[-3000:]
    shown = versions(fresh)
    assert int(shown["transformers"].split(".")[0]) >= 5 and int(shown["huggingface_hub"].split(".")[0]) >= 1
    # The tests and the harness without the package: `import ds_clip` finds the wheel, in pytest and in every
    # process the tests launch (their PYTHONPATH holds this copy's root, which has no ds_clip/).
    copy = checkout_copy(fresh["cwd"] / "suite", only=("tests", "ds_clip_harness", "pyproject.toml"))
    proc = run([venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "newest_clients",
                 "tests/test_hub.py", "tests/test_hf_export.py"], cwd=copy, env=env, timeout=1800)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", out) and " skipped" not in out, out[-3000:]


def test_transformers_exports_load_across_4_and_5(fresh):
    """A transformers export made with the newest transformers (5.x, installed by the test above) loads with the
    oldest the `hf` extra declares (4.40, put in front of it on PYTHONPATH: transformers 5 needs a newer torch
    than the oldest environment's), and the 4.40 export loads with 5.x: AutoProcessor, CLIPProcessor,
    AutoTokenizer, AutoModel and pipeline("zero-shot-image-classification"), with the same token ids, logits and
    scores. The run exported is the one the default-preset test trained."""
    venv, env = fresh["venv"], fresh["env"]
    added = run([venv / "bin" / "python", "-m", "pip", "install", "-q", f"{fresh['wheel']}[hf]"], cwd=fresh["cwd"],
                env=env, timeout=1800)  # already there after the test above; its newest transformers otherwise  # fmt: skip
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr[-3000:]
    assert int(versions(fresh)["transformers"].split(".")[0]) >= 5
    check_exports_load_across_transformers(fresh, fresh["cwd"] / "logs" / "default", "transformers==4.40.0")
