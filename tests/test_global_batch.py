"""--global-batch-size and --recipe: k = N / (W*m) derived by BatchGeometry, refusals in one line (exit 2),
recipes shipped in the package, and the dry run that prints the k each world size would use.

    python -m pytest -q tests/test_global_batch.py        # seconds; no process group
"""

from __future__ import annotations

import json

import pytest

from ds_clip import train
from ds_clip.config import SettingsError, TrainSettings, parse_settings
from ds_clip.config.recipes import RECIPE_DIR, list_recipes, load_recipe
from ds_clip.geometry import BatchGeometry, GeometryError, micro_batches_for, world_sizes_for
from ds_clip.training.engine import resolve_geometry


@pytest.mark.parametrize("world, k", [(1, 512), (2, 256), (8, 64)])
def test_k_is_derived_from_n_on_each_world_size(world, k):
    g = BatchGeometry.derive(world, 8, global_batch=4096)
    assert (g.world_size, g.accum_freq, g.micro_batch_size, g.global_batch) == (world, k, 8, 4096)


def test_without_n_k_is_accum_freq_or_1():
    assert BatchGeometry.derive(2, 8).accum_freq == 1
    assert BatchGeometry.derive(2, 8, accum_freq=3).global_batch == 48


def test_an_accum_freq_that_agrees_is_accepted_one_that_disagrees_is_refused():
    assert BatchGeometry.derive(2, 8, accum_freq=4, global_batch=64).accum_freq == 4
    with pytest.raises(
        GeometryError, match=r"--accum-freq 2 disagrees with --global-batch-size 64: .* k = 4"
    ):
        BatchGeometry.derive(2, 8, accum_freq=2, global_batch=64)


def test_n_that_w_times_m_does_not_divide_names_what_would():
    with pytest.raises(GeometryError) as e:
        BatchGeometry.derive(3, 8, global_batch=64)
    text = str(e.value)
    assert "\n" not in text
    assert "on 3 ranks: W*m = 3*8 = 24 does not divide it" in text
    assert "with --batch-size 8 it divides on world sizes 1, 2, 4, 8" in text
    with pytest.raises(GeometryError, match=r"on 2 ranks these --batch-size values do: 1, 2, 5, 10, 25, 50"):
        BatchGeometry.derive(2, 8, global_batch=100)
    assert world_sizes_for(4096, 48) == [] and micro_batches_for(4096, 3) == []


def test_resolve_geometry_turns_a_bad_world_size_into_a_settings_error():
    s = TrainSettings.of(batch_size=8, global_batch_size=64)
    assert resolve_geometry(s, 4).accum_freq == 2
    with pytest.raises(SettingsError, match="on 3 ranks"):
        resolve_geometry(s, 3)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--global-batch-size", "100", "--batch-size", "8"], "is not a multiple of --batch-size 8"),
        (
            ["--global-batch-size", "64", "--accum-freq", "3"],
            "--accum-freq 3 disagrees with --global-batch-size 64",
        ),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
        (["--recipe", "datacomp-medium", "--global-batch-size", "8192"], "the recipe fixes N"),
        (["--recipe", "no-such-recipe"], "neither a shipped recipe (datacomp-large, datacomp-medium"),
        (["--recipe", "missing.json"], "--recipe missing.json: no such file"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, needle):
    with pytest.raises(SettingsError) as e:
        parse_settings(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_every_shipped_recipe_loads_fixes_n_and_never_sets_m_or_k():
    names = list_recipes()
    assert {"datacomp-small", "datacomp-medium", "datacomp-large", "datacomp-xlarge"} <= set(names)
    assert any(n.startswith("laion400m-") for n in names)
    for name in names:
        settings = load_recipe(name)["settings"]
        assert settings["global_batch_size"] >= 1
        assert not {"batch_size", "accum_freq"} & set(settings), name
        s = parse_settings(["--recipe", name])
        assert s.optim.global_batch_size == settings["global_batch_size"] and s.optim.accum_freq is None


def test_datacomp_scales_as_the_paper_sets_them():
    expected = {  # model, N, LR, warmup, samples seen
        "small": ("ViT-B-32", 4096, 5e-4, 500, 12_800_000),
        "medium": ("ViT-B-32", 4096, 5e-4, 500, 128_000_000),
        "large": ("ViT-B-16", 8192, 5e-4, 500, 1_280_000_000),
        "xlarge": ("ViT-L-14", 90112, 1e-3, 10000, 12_800_000_000),
    }
    for scale, (model, n, lr, warmup, seen) in expected.items():
        s = parse_settings(["--recipe", f"datacomp-{scale}"])
        assert (s.model.model, s.optim.global_batch_size, s.optim.lr, s.optim.warmup) == (
            model,
            n,
            lr,
            warmup,
        )
        assert s.optim.epochs * s.data.train_num_samples == seen
    assert parse_settings(["--recipe", "datacomp-xlarge"]).optim.beta2 == 0.95


def test_command_line_flags_override_a_recipe(tmp_path):
    s = parse_settings(
        ["--recipe", "datacomp-medium", "--lr", "5e-4", "--warmup", "7", "--model", "ds-clip-tiny"]
    )
    assert (s.optim.lr, s.optim.warmup, s.model.model, s.optim.global_batch_size) == (
        5e-4,
        7,
        "ds-clip-tiny",
        4096,
    )
    # the same N given again is no conflict
    assert (
        parse_settings(["--recipe", "datacomp-medium", "--global-batch-size", "4096"]).optim.global_batch_size
        == 4096
    )
    mine = tmp_path / "mine.json"
    mine.write_text(
        json.dumps({"settings": {"global_batch_size": 32, "lr": 1e-4, "grad_checkpointing": True}})
    )
    s = parse_settings(["--recipe", str(mine)])
    assert (s.optim.global_batch_size, s.optim.lr, s.model.grad_checkpointing) == (32, 1e-4, True)


@pytest.mark.parametrize(
    "settings, needle",
    [
        ({"no_such_flag": 1}, "'no_such_flag' is not a setting a recipe can set"),
        ({"lr": "fast"}, "lr must be a JSON float (--lr)"),
        ({"warmup": 1.5}, "warmup must be a JSON int (--warmup)"),
        ({"grad_checkpointing": 1}, "must be true or false"),
        ({"lr_scheduler": "linear"}, "lr_scheduler must be one of cosine"),
    ],
)
def test_a_bad_recipe_file_is_one_line_naming_the_key(tmp_path, settings, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"settings": settings}))
    with pytest.raises(SettingsError, match="--recipe .*bad.json"):
        try:
            parse_settings(["--recipe", str(bad)])
        except SettingsError as e:
            assert needle in str(e)
            raise


def test_recipes_sit_beside_the_presets_in_the_package():
    assert RECIPE_DIR.parent.joinpath("ds_configs").is_dir()
    assert all(p.name.endswith(".json") for p in RECIPE_DIR.iterdir() if p.is_file())


@pytest.mark.parametrize("world, k", [(1, 512), (2, 256), (8, 64)])
def test_dry_run_with_a_recipe_prints_the_k_it_would_use(world, k, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train.main(["--dry-run", "--recipe", "datacomp-medium"]) == 0
    out = capsys.readouterr().out
    assert f"# batch: world size {world}, micro-batch m=8, accum-freq k={k}: global batch N=W*k*m=4096" in out
    assert "W=1: k=512, W=2: k=256, W=4: k=128, W=8: k=64" in out


def test_dry_run_on_a_world_size_that_cannot_divide_n_is_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert train.main(["--dry-run", "--global-batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "on 3 ranks" in err[0] and "world sizes 1, 2, 4, 8" in err[0]


def test_run_name_records_n_instead_of_k():
    s = parse_settings(["--global-batch-size", "64"])
    assert s.logging.name.endswith("-m_8-N_64")


def test_a_data_position_saved_on_one_split_resumes_the_same_pairs_on_another(caplog):
    """Synthetic pairs are assigned by global sample index: a position saved on (W=2, k=2) loads on (W=4, k=1)
    without the "not the same samples" warning, and the next step trains the pairs the uninterrupted run would.
    Another N still warns."""
    import logging

    import torchvision.transforms as T

    from ds_clip.data.loader import DataSettings, build_train_data
    from tests.data.tokens import byte_tokenizer, detok

    settings = DataSettings(dataset_type="synthetic", train_num_samples=64, workers=0, seed=3)
    pre = T.Compose([T.Resize((8, 8)), T.ToTensor()])

    def data(w: int, k: int, rank: int, m: int = 2):
        return build_train_data(
            settings, preprocess=pre, tokenizer=byte_tokenizer, rank=rank, geometry=BatchGeometry(w, k, m)
        )

    saved = data(2, 2, 0)
    it = saved.iter_epoch(0)
    next(it), next(it)  # two steps trained on (W=2, k=2)
    state = saved.state_dict()

    def step_pairs(w: int, k: int, load: bool) -> set[str]:
        pairs: set[str] = set()
        for rank in range(w):
            d = data(w, k, rank)
            if load:
                d.load_state_dict(state)
            batch = next(d.iter_epoch(d.epoch, d.step_in_epoch if load else 2))
            pairs |= {detok(t) for _, texts in batch.micro_batches for t in texts}
        return pairs

    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        resumed = step_pairs(4, 1, load=True)
    assert "data position was saved" not in caplog.text
    assert resumed == step_pairs(2, 2, load=False) and len(resumed) == 8
    with caplog.at_level(logging.WARNING, logger="ds_clip.data"):
        data(2, 4, 0).load_state_dict(state)  # N = 16, not 8
    assert "data position was saved" in caplog.text
