"""What the install tests share (tests/test_install.py: the newest dependencies; tests/test_install_oldest.py:
each pinned to its declared minimum): the wheel, a fresh virtual environment with the wheel installed from the
package index, and the check that `ds-clip-train --version` names what pip installed and two ranks train.

An environment holds a full torch (several GB): each module removes its own when its tests end, so a run never
holds two (a CI machine's disk is not large).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import tomllib
from packaging.version import Version

from ds_clip_harness.models import E2E_MODEL

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


def fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def user_env(fresh: Path) -> dict[str, str]:
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


def run(cmd: list, cwd: Path, env: dict[str, str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def checkout_copy(dest: Path, only: tuple[str, ...] = ()) -> Path:
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


def build_wheel(tmp: Path) -> Path:
    """The wheel, built into TMP from a copy of the checkout (what a clone holds)."""
    src = checkout_copy(tmp / "src")
    dist = tmp / "dist"
    built = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", dist, src],
        cwd=tmp, env=dict(os.environ),
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (whl,) = dist.glob("ds_clip-*.whl")
    return whl


def install(tmp: Path, requirement: str, constraints: dict[str, str] | None = None) -> dict:
    """A fresh venv with ``pip install REQUIREMENT`` resolved from the index, as a user runs it."""
    venv = tmp / "venv"
    made = run([sys.executable, "-m", "venv", venv], cwd=tmp, env=dict(os.environ))
    assert made.returncode == 0, made.stderr
    env = user_env(venv)
    # The checkout's ds_clip must be invisible before the wheel is installed.
    before = run([venv / "bin" / "python", "-c", "import ds_clip"], cwd=tmp, env=env)
    assert before.returncode != 0 and "No module named 'ds_clip'" in before.stderr, before.stderr[-2000:]
    pins = []
    if constraints is not None:
        (tmp / "constraints.txt").write_text("".join(f"{k}=={v}\n" for k, v in constraints.items()))
        pins = ["-c", tmp / "constraints.txt"]
    installed = run([venv / "bin" / "python", "-m", "pip", "install", "-q", requirement, *pins],
                     cwd=tmp, env=env, timeout=1800)  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    model = tmp / "model"
    model.mkdir()
    (model / "open_clip_config.json").write_text(json.dumps({"model_cfg": E2E_MODEL, "preprocess_cfg": {}}))
    work = tmp / "elsewhere"  # cwd of every run: outside the repository, no ds_configs/ beside it
    work.mkdir()
    return {"venv": venv, "env": env, "model": f"local-dir:{model}", "cwd": work}


@contextlib.contextmanager
def installed(tmp: Path, requirement: str, constraints: dict[str, str] | None = None) -> Iterator[dict]:
    """`install`, and the environment removed when the block ends, passed or failed: it is rebuilt from the
    index in minutes and holds several GB, and a full disk would fail every later test."""
    try:
        yield install(tmp, requirement, constraints)
    finally:
        shutil.rmtree(tmp / "venv", ignore_errors=True)


def versions(env: dict) -> dict[str, str]:
    """What `ds-clip-train --version` prints, as {package: version}."""
    proc = run([env["venv"] / "bin" / "ds-clip-train", "--version"], cwd=env["cwd"], env=env["env"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(part.strip().split(" ", 1) for part in proc.stdout.strip().split(" | "))


def pip_versions(env: dict) -> dict[str, str]:
    proc = run([env["venv"] / "bin" / "python", "-m", "pip", "list", "--format", "json"],
                cwd=env["cwd"], env=env["env"])  # fmt: skip
    return {p["name"].lower().replace("-", "_"): p["version"] for p in json.loads(proc.stdout)}


def check_versions_and_two_ranks(env: dict, oldest: bool) -> None:
    """`ds-clip-train --version` prints the versions pip installed; then `deepspeed --num_gpus 2 --module
    ds_clip.train` (the environment's own launcher, from outside the repository) trains two steps on two CPU
    ranks, and the start logs the same versions once."""
    shown, installed = versions(env), pip_versions(env)
    assert list(shown) == [*SHOWN_PACKAGES, "python"], shown
    dists = {"open_clip": "open_clip_torch"}
    for name in SHOWN_PACKAGES:
        assert shown[name] == installed.get(dists.get(name, name), "not installed"), (name, shown, installed)
    if oldest:
        for dist, low in declared_minimums().items():
            got = Version(installed[dist.lower().replace("-", "_")])
            # 2.4.0 (or 2.4.0+cpu) is the 2.4 declared
            assert Version(got.base_version) == Version(low), (dist, got, low)
    else:  # the client that removed reset_sessions: the newest install must meet it
        assert int(shown["huggingface_hub"].split(".")[0]) >= 1, shown

    logs = env["cwd"] / "logs"
    proc = run(
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


# Runs in a fresh environment (its transformers, or the other major release put in front of it on PYTHONPATH):
# loads an export folder with AutoProcessor, CLIPProcessor, AutoTokenizer, AutoModel and the zero-shot pipeline,
# and prints what they give as one line of JSON.
LOAD_EXPORT = """
import json, sys
import numpy as np, torch, transformers
from PIL import Image
from transformers import AutoModel, AutoProcessor, AutoTokenizer, CLIPProcessor, pipeline
folder = sys.argv[1]
processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
clip_processor = CLIPProcessor.from_pretrained(folder, local_files_only=True)
tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
ids = tokenizer(["a red circle", "Wow, a BLUE square"], padding="max_length", truncation=True)["input_ids"]
# "!" is the pad token's text: an ordinary token from 4.42 on (split_special_tokens), padding in 4.40 and 4.41
bang = tokenizer(["a photo!"], padding="max_length", truncation=True)["input_ids"]
image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8), "RGB")
scores = pipeline("zero-shot-image-classification", model=folder)(image, candidate_labels=["a circle", "a square"])
model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
# The model alone on fixed pixels (5.x's default image processor resizes with torch, within an 8-bit level of
# 4.x's PIL one: the pipeline's scores agree to that).
side = processor.image_processor.crop_size["height"]
pixels = torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    text = processor(text=["a circle", "a square"], return_tensors="pt", padding=True)
    logits = model(pixel_values=pixels, input_ids=text["input_ids"], attention_mask=text["attention_mask"])
print("LOADED " + json.dumps({
    "transformers": transformers.__version__, "processor": type(processor).__name__,
    "clip_processor": type(clip_processor).__name__, "ids": ids, "bang": bang,
    "scores": {s["label"]: s["score"] for s in scores}, "logits": logits.logits_per_image.tolist()}))
"""


def check_exports_load_across_transformers(env: dict, run_dir: Path, other: str) -> None:
    """A transformers export of RUN_DIR made with the environment's transformers loads with the OTHER major
    release (a requirement, put on PYTHONPATH in front of the environment's own, no second venv), and the
    reverse: AutoProcessor, CLIPProcessor, AutoTokenizer, AutoModel and pipeline("zero-shot-image-classification")
    on both folders, with the same token ids, logits and pipeline scores (two exports of one checkpoint)."""
    overlay = env["cwd"] / "other_transformers"
    added = run([env["venv"] / "bin" / "python", "-m", "pip", "install", "-q", "--target", overlay, other],
                cwd=env["cwd"], env=env["env"], timeout=1800)  # fmt: skip
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr[-3000:]
    own_env = env["env"]
    other_env = {
        **own_env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(overlay), own_env.get("PYTHONPATH")])),
    }
    folders = {"own": env["cwd"] / "export_own", "other": env["cwd"] / "export_other"}
    for who, made_env in (("own", own_env), ("other", other_env)):
        made = run([env["venv"] / "bin" / "ds-clip-export", run_dir, folders[who], "--format", "transformers"],
                   cwd=env["cwd"], env=made_env)  # fmt: skip
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    loaded = {}
    for made, loader in (("own", "other"), ("other", "own")):  # each release's export, loaded by the other
        proc = run([env["venv"] / "bin" / "python", "-c", LOAD_EXPORT, folders[made]], cwd=env["cwd"],
                   env=own_env if loader == "own" else other_env)  # fmt: skip
        assert proc.returncode == 0, (made, loader, (proc.stdout + proc.stderr)[-4000:])
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED ")]
        loaded[made, loader] = json.loads(line[len("LOADED ") :])
    versions = {got["transformers"] for got in loaded.values()}
    assert len({v.split(".")[0] for v in versions}) == 2, versions  # two major releases, 4.x and 5.x
    # The environment's own (the newest) release reading the other's export is the reference.
    first = loaded["other", "own"]
    assert first["processor"] == first["clip_processor"] == "CLIPProcessor", first
    for key, got in loaded.items():
        assert got["processor"] == "CLIPProcessor" and got["ids"] == first["ids"], (key, got, first)
        # "!" splits from 4.42 on (model card: 4.40 and 4.41 read it as padding)
        assert (got["bang"] == first["bang"]) == (Version(got["transformers"]) >= Version("4.42")), (key, got)
        for label, score in first["scores"].items():
            assert abs(got["scores"][label] - score) < 1e-3, (key, got, first)
        assert np.allclose(got["logits"], first["logits"], atol=1e-4), (key, got, first)
