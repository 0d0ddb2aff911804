"""Published weights, hub models and hub tokenizers, fetched from a stand-in hub on 127.0.0.1 (tests/hub_server.py)
by the real huggingface_hub client and open_clip's own loaders, under the real launchers.

The real open_clip tag: `--model ViT-B-32 --pretrained laion2b_s34b_b79k` resolves, through open_clip's own
pretrained table, to its real repo id laion/CLIP-ViT-B-32-laion2B-s34B-b79K. A real ViT-B-32 (151M parameters)
is too large for these CPU tests, so the test processes register a tiny model config under the name ViT-B-32
(a sitecustomize.py on their PYTHONPATH calls open_clip.add_model_config) and the stand-in hub serves tiny
weights of that shape under the real repo id. Everything else (the tag table, the repo id, the file names, the
download, the cache layout) is open_clip's and huggingface_hub's own.

The tests marked `newest_clients` take each path through the hub client once (a tag's weights offline, cached and
fetched; an hf-hub: model with its hub tokenizer through transformers under the launcher; the client's errors;
timm's weights): tests/test_install.py runs them again with the newest transformers and huggingface_hub.

`--resume latest` on a first start (nothing saved yet) loads the published weights, never random ones: a tag's in
the two-host test, an hf-hub: model's in the fetch-once test, a local-dir: model's own in
tests/test_feature_pairs.py (run 1); the table of where a start's weights come from is tests/test_weights.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_clip_harness.models import E2E_MODEL
from tests import launch
from tests.hub_server import StandInHub
from tests.launch import ROOT

TAG_REPO = "laion/CLIP-ViT-B-32-laion2B-s34B-b79K"
HUB_MODEL = "ds-clip-test/tiny-clip"
TOKENIZER_REPO = "ds-clip-test/tiny-tokenizer"
WEIGHTS = "open_clip_model.safetensors"
M, K = 4, 2


def _weights(model_cfg: dict, seed: int) -> tuple[bytes, dict[str, torch.Tensor]]:
    import open_clip
    from safetensors.torch import save

    torch.manual_seed(seed)
    model = open_clip.create_model("local-dir:" + str(_cfg_dir(model_cfg)))
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return save(state), state


def _cfg_dir(model_cfg: dict) -> Path:
    import tempfile

    d = Path(tempfile.mkdtemp())
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}))
    return d


def _tokenizer_files() -> dict[str, bytes]:
    """A tiny word-level Hugging Face tokenizer (what transformers' AutoTokenizer loads from a hub repo)."""
    import tempfile

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a an the of on in with red green blue small large circle square triangle star background".split()
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    out = Path(tempfile.mkdtemp())
    fast.save_pretrained(str(out))
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


# The hub model: a tiny CLIP whose tokenizer lives in another hub repo (as SigLIP's and multilingual models' do).
HUB_MODEL_CFG = {
    **E2E_MODEL,
    "text_cfg": {**E2E_MODEL["text_cfg"], "vocab_size": 64, "hf_tokenizer_name": TOKENIZER_REPO},
}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    configs = site / "configs"
    configs.mkdir()
    (configs / "ViT-B-32.json").write_text(
        json.dumps(E2E_MODEL)
    )  # the tiny stand-in for the real tag's model
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('DS_CLIP_TEST_CONFIGS'):\n"
        "    import open_clip\n"
        "    open_clip.add_model_config(os.environ['DS_CLIP_TEST_CONFIGS'])\n"
    )
    tag_bytes, tag_state = _weights(E2E_MODEL, seed=11)
    model_bytes, model_state = _weights(HUB_MODEL_CFG, seed=12)
    with StandInHub() as h:
        h.add_repo(TAG_REPO, {WEIGHTS: tag_bytes})
        h.add_repo(
            HUB_MODEL,
            {
                "open_clip_config.json": json.dumps(
                    {"model_cfg": HUB_MODEL_CFG, "preprocess_cfg": {}}
                ).encode(),
                WEIGHTS: model_bytes,
            },
        )
        h.add_repo(TOKENIZER_REPO, _tokenizer_files())
        h.site, h.configs = site, configs
        h.states = {TAG_REPO: tag_state, HUB_MODEL: model_state}
        yield h


def _env(hub: StandInHub, cache: Path, **extra: str) -> dict[str, str]:
    env = launch.environment(
        PYTHONPATH=f"{hub.site}{os.pathsep}{ROOT}",
        HF_ENDPOINT=hub.url,
        HF_HOME=str(cache),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        DS_CLIP_TEST_CONFIGS=str(hub.configs),
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return launch.run(cmd, env=env, timeout=timeout)


def _train_args(model: str, logs: Path, name: str, *extra: str, steps: int = 2) -> list[str]:
    return [
        "--model", model, "--batch-size", str(M), "--accum-freq", str(K), "--max-steps", str(steps),
        "--log-every-n-steps", "1", "--log-dir", str(logs), "--name", name, "--workers", "0", *extra,
    ]  # fmt: skip


def _exported(run_dir: Path, out: Path, env: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    proc = _run([sys.executable, "-m", "ds_clip.export", str(run_dir), str(out)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / WEIGHTS))


def test_bad_tags_and_names_are_one_line(monkeypatch):
    """An unknown tag, a tag of another model, a tag for a built-in model and --pretrained with an hf-hub: model
    are refused at parse time naming the flag (exit 2 through ds-clip-train)."""
    from ds_clip.config import SettingsError, parse_settings

    cases = [
        (["--model", "ViT-B-16", "--pretrained", "laion2b_s34b_b79k"], "is a tag of ViT-B-32"),
        (["--model", "ViT-B-32", "--pretrained", "no_such_tag"], "neither a file nor an open_clip tag"),
        (["--model", "ds-clip-tiny", "--pretrained", "openai"], "has no open_clip tags"),
        (["--model", "hf-hub:org/repo", "--pretrained", "openai"], "the repo brings its own weights"),
        (["--model", "hf-hub:justone"], "hf-hub:ORG/REPO"),
        (["--model", "ViT-B-32", "--pretrained", "ftp://x/y.pt"], r"only http\(s\) URLs"),
    ]
    for argv, needle in cases:
        with pytest.raises(SettingsError, match=needle) as info:
            parse_settings(argv)
        assert "\n" not in str(info.value)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.newest_clients
def test_offline_uncached_is_refused_and_dry_run_lists_the_files(hub, tmp_path):
    """HF_HUB_OFFLINE=1 and an empty cache: exit 2 before anything starts, one line naming the tag's repo, the
    file, the cache folder and the command that fills it; no request reaches the hub. --dry-run lists the files
    and whether each is cached; `python -m ds_clip.fetch` fills the cache, after which the offline dry run
    says cached."""
    hub.reset()
    cache = tmp_path / "hf"
    offline = _env(hub, cache, HF_HUB_OFFLINE="1")
    args = ["--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k", "--logs", str(tmp_path / "logs")]
    proc = _run([sys.executable, "-m", "ds_clip.train", *args], offline)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in (TAG_REPO, WEIGHTS, str(cache / "hub"), "python -m ds_clip.fetch --model ViT-B-32"):
        assert needle in lines[0], lines[0]
    proc = _run([sys.executable, "-m", "ds_clip.train", *args, "--dry-run"], _env(hub, cache))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        f"--pretrained laion2b_s34b_b79k: {TAG_REPO} {WEIGHTS} or open_clip_pytorch_model.bin: to fetch"
        in proc.stdout
    )
    assert hub.total() == 0
    proc = _run([sys.executable, "-m", "ds_clip.fetch", "--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k"],
                _env(hub, cache))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert hub.gets(TAG_REPO, WEIGHTS) == 1
    proc = _run([sys.executable, "-m", "ds_clip.train", *args, "--dry-run"], offline)
    assert proc.returncode == 0 and "open_clip_pytorch_model.bin: cached (" in proc.stdout, proc.stdout[
        -2000:
    ]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.newest_clients
def test_two_ranks_fetch_once_lock_image_keeps_the_hub_tower_and_resume_fetches_nothing(hub, tmp_path):
    """`deepspeed --num_gpus 2 --module ds_clip.train --model hf-hub:ORG/REPO` (a hub tokenizer in another repo)
    on ZeRO-3 with --lock-image and `--resume latest` from the very first start (the one command of a re-queued
    job): each file is downloaded once (local rank 0 fetches, the other rank waits and reads the cache); with
    nothing saved yet the run starts from the hub's weights, never from random ones, and says so; the exported
    image tower is bit-identical to the hub's and the text tower trained. The same command again makes no
    request at all (the checkpoint holds the weights), and an offline run from the filled cache makes none
    either."""
    hub.reset()
    env = _env(hub, tmp_path / "hf")
    # --skip-scheduler: a constant LR, so the resumed step still moves the text tower (a cosine schedule restored
    # from the 2-step run would be at its end, LR 0).
    lit = ("--zero-stage", "3", "--lock-image", "--skip-scheduler", "--resume", "latest")
    args = _train_args(f"hf-hub:{HUB_MODEL}", tmp_path / "logs", "hub", *lit)
    proc = _run(launch.deepspeed(*args), env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    start = [ln for ln in out.splitlines() if "no complete checkpoint" in ln]
    assert start and f"the weights of --model hf-hub:{HUB_MODEL}" in start[0], (start, out[-3000:])
    for repo, name in (
        (HUB_MODEL, "open_clip_config.json"),
        (HUB_MODEL, WEIGHTS),
        (TOKENIZER_REPO, "tokenizer.json"),
    ):
        assert hub.gets(repo, name) == 1, (repo, name, dict(hub.requests))
    hub_state = hub.states[HUB_MODEL]
    exported = _exported(tmp_path / "logs" / "hub", tmp_path / "export", env)
    visual = [k for k in hub_state if k.startswith("visual.")]
    assert visual and all(torch.equal(exported[k], hub_state[k]) for k in visual)
    assert not torch.equal(exported["text_projection"], hub_state["text_projection"])
    # The export carries the hub tokenizer (open_clip reads a local-dir: model's tokenizer from its folder).
    assert (tmp_path / "export" / "tokenizer.json").is_file()

    hub.reset()
    more = _train_args(f"hf-hub:{HUB_MODEL}", tmp_path / "logs", "hub", *lit, steps=3)
    proc = _run(launch.deepspeed(*more), env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "at step 2" in out, out[-4000:]
    assert hub.total() == 0, dict(hub.requests)
    resumed = _exported(tmp_path / "logs" / "hub", tmp_path / "export2", env)
    assert all(torch.equal(resumed[k], hub_state[k]) for k in visual)
    assert not torch.equal(resumed["text_projection"], exported["text_projection"])  # trained on from step 2

    offline = {**env, "HF_HUB_OFFLINE": "1"}
    proc = _run(
        launch.deepspeed(*_train_args(f"hf-hub:{HUB_MODEL}", tmp_path / "logs", "offline", steps=1)), offline
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert hub.total() == 0, dict(hub.requests)


@pytest.mark.e2e
@pytest.mark.slow
def test_real_tag_on_two_hosts_fetches_once_per_host_and_first_eval_equals_open_clips(hub, tmp_path):
    """Two hosts (two torchrun agents, one rank each, each with its own cache) train ViT-B-32 from the real tag
    laion2b_s34b_b79k, with `--resume latest` from the very first start (the one command of a re-queued job):
    each host downloads the weights once, and with nothing saved yet the run says it starts from the tag. With
    --lr 1e-12 the one step moves no weight by more than 1e-12 (below float32's resolution of almost all of them;
    --lr must be > 0), so the run's evaluation is its evaluation of the tag's weights, never of random ones, and it
    equals ds-clip-eval's evaluation of open_clip.create_model_and_transforms("ViT-B-32",
    pretrained="laion2b_s34b_b79k") read offline from one host's cache (no request)."""
    hub.reset()
    port = launch.free_port()
    args = _train_args("ViT-B-32", tmp_path / "logs", "tag", "--pretrained", "laion2b_s34b_b79k", "--lr", "1e-12",
                       "--val-data", "synthetic", "--val-num-samples", "64", "--resume", "latest", steps=1)  # fmt: skip
    procs = []
    for node in (0, 1):
        cmd = launch.torchrun(*args, nodes=2, node_rank=node, port=port)
        env = _env(hub, tmp_path / f"host{node}")
        procs.append(launch.start(cmd, env=env, merge_stderr=True))
    outs = [launch.finish(p).stdout for p in procs]
    errors = [ln for o in outs for ln in o.splitlines() if "error" in ln.lower()]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(errors[:20]) or outs[0][-3000:]
    assert hub.gets(TAG_REPO, WEIGHTS) == 2, dict(hub.requests)
    start = [ln for o in outs for ln in o.splitlines() if "no complete checkpoint" in ln]
    assert start and "the model starts from --pretrained laion2b_s34b_b79k" in start[0], start
    for node in (0, 1):
        assert list((tmp_path / f"host{node}" / "hub").glob(f"models--laion--*/snapshots/*/{WEIGHTS}"))
    evaluated = json.loads((tmp_path / "logs" / "tag" / "eval_results.json").read_text())[-1]

    hub.reset()
    env = _env(hub, tmp_path / "host1", HF_HUB_OFFLINE="1")
    proc = _run([sys.executable, "-m", "ds_clip.evaluate", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k",
                 "--val-data", "synthetic", "--val-num-samples", "64", "--batch-size", str(M)], env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.total() == 0
    reference = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert reference["val_loss"] == pytest.approx(evaluated["val_loss"], rel=1e-5, abs=1e-6)
    for key in ("image_to_text_R@1", "text_to_image_R@1"):
        if key in reference:
            assert reference[key] == pytest.approx(evaluated[key], abs=1e-6)

    # The same weights named as a hub repo (offline, from the same cache) and as a URL (fetched once into
    # --cache-dir) evaluate the same.
    url = hub.add_file("/weights/tiny-vit-b-32.pt", _pt_bytes(hub.states[TAG_REPO]))
    for pretrained, extra_env in ((f"hf-hub:{TAG_REPO}", {"HF_HUB_OFFLINE": "1"}), (url, {})):
        hub.reset()
        env = _env(hub, tmp_path / "host1", **extra_env)
        cmd = [sys.executable, "-m", "ds_clip.evaluate", "ViT-B-32", "--pretrained", pretrained, "--cache-dir",
               str(tmp_path / "host1" / "hub"), "--val-data", "synthetic", "--val-num-samples", "64"]  # fmt: skip
        proc = _run(cmd, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        same = json.loads(proc.stdout[proc.stdout.index("{") :])
        assert same["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-6)
        assert hub.total() == (0 if pretrained.startswith("hf-hub:") else 1), dict(hub.requests)


def _pt_bytes(state: dict[str, torch.Tensor]) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.newest_clients
def test_unknown_repo_and_unreachable_hub_are_one_line_exit_2(hub, tmp_path):
    """A repo the hub does not have, and a hub that does not answer: exit 2 before any engine starts, one line
    naming the flag, the repo, the file and the cache folder."""
    _, closed_port = launch.free_port(), launch.free_port()
    for endpoint, repo in (
        (hub.url, "ds-clip-test/no-such-model"),
        (f"http://127.0.0.1:{closed_port}", HUB_MODEL),
    ):
        env = _env(
            hub, tmp_path / "hf", HF_ENDPOINT=endpoint, HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5"
        )
        proc = _run(
            [sys.executable, "-m", "ds_clip.train", *_train_args(f"hf-hub:{repo}", tmp_path / "logs", "x")],
            env,
        )
        assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ds-clip-train: error:")]
        assert len(errors) == 1, proc.stderr[-3000:]
        for needle in (
            f"--model hf-hub:{repo}",
            "could not fetch",
            "open_clip_config.json",
            str(tmp_path / "hf"),
        ):
            assert needle in errors[0], errors[0]
        assert "Traceback" not in proc.stderr


TIMM_REPO = "timm/test_vit.r160_in1k"  # timm's pretrained config of its tiny test_vit


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.newest_clients
def test_pretrained_image_loads_timms_hub_weights_into_the_image_tower(hub, tmp_path):
    """--pretrained-image: the timm image tower starts from timm's hub weights (fetched once, into the cache);
    with --lock-image they come out of training and export bit-identical. Started with --resume latest (nothing
    saved yet): a first start loads them as a start without --resume does."""
    import timm
    from safetensors.torch import save

    torch.manual_seed(13)
    trunk = {k: v.contiguous() for k, v in timm.create_model("test_vit").state_dict().items()}
    hub.add_repo(TIMM_REPO, {"model.safetensors": save(trunk)})
    hub.reset()
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "timm_model_name": "test_vit",
            "timm_pool": "avg",
            "timm_proj": "linear",
        },
        "text_cfg": E2E_MODEL["text_cfg"],
    }
    folder = _cfg_dir(cfg)
    env = _env(hub, tmp_path / "hf")
    args = _train_args(
        f"local-dir:{folder}",
        tmp_path / "logs",
        "timm",
        "--pretrained-image",
        "--lock-image",
        "--resume",
        "latest",
        steps=1,
    )
    proc = _run([sys.executable, "-m", "ds_clip.train", *args], env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert hub.gets(TIMM_REPO, "model.safetensors") == 1, dict(hub.requests)
    exported = _exported(tmp_path / "logs" / "timm", tmp_path / "export", env)
    compared = [k for k in trunk if f"visual.trunk.{k}" in exported and not k.startswith("head")]
    assert compared and all(torch.equal(exported[f"visual.trunk.{k}"], trunk[k]) for k in compared)


@pytest.mark.e2e
@pytest.mark.slow
def test_distill_from_a_pretrained_tag_fetches_the_teacher_once_per_host(hub, tmp_path):
    """`--distill-model ViT-B-32 --distill-pretrained laion2b_s34b_b79k` under `deepspeed --num_gpus 2`: offline
    with an empty cache the teacher's weights are refused in one line naming the tag's repo (no request, no
    traceback); online, local rank 0 fetches them once and both ranks train the student against that teacher."""
    from ds_clip_harness.models import write_pretrained_dir

    student = write_pretrained_dir(tmp_path / "student", E2E_MODEL)
    teacher = ("--distill-model", "ViT-B-32", "--distill-pretrained", "laion2b_s34b_b79k")
    hub.reset()
    offline = _env(hub, tmp_path / "hf", HF_HUB_OFFLINE="1")
    proc = _run(
        launch.deepspeed(*_train_args(student, tmp_path / "logs", "refused", *teacher, steps=1)), offline
    )
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ds-clip-train: error:")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors and TAG_REPO in errors[0] and len(set(errors)) == 1, proc.stderr[-3000:]
    assert hub.total() == 0, dict(hub.requests)

    hub.reset()
    proc = _run(
        launch.deepspeed(*_train_args(student, tmp_path / "logs", "distill", *teacher)),
        _env(hub, tmp_path / "hf"),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert hub.gets(TAG_REPO, WEIGHTS) == 1, dict(hub.requests)
    settings = json.loads((tmp_path / "logs" / "distill" / "settings.json").read_text())
    assert (settings["distill_model"], settings["distill_pretrained"]) == ("ViT-B-32", "laion2b_s34b_b79k")
    assert (tmp_path / "logs" / "distill" / "checkpoints" / "latest_complete").exists()
