"""ds_clip installed with every runtime dependency at the lowest version pyproject.toml declares: the wheel goes
into a fresh virtual environment with `pip install WHEEL -c constraints.txt` (each dependency pinned to its
declared minimum, the rest resolved from the package index), `ds-clip-train --version` names exactly those
versions, and two CPU ranks under the environment's own deepspeed launcher train two steps from a folder outside
the repository. The newest end of the ranges: tests/test_install.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.installs import build_wheel, check_versions_and_two_ranks, declared_minimums, installed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def oldest(tmp_path_factory) -> Iterator[dict]:
    """oldest: every runtime dependency pinned to its declared minimum."""
    wheel = build_wheel(tmp_path_factory.mktemp("wheel"))
    with installed(tmp_path_factory.mktemp("oldest"), str(wheel), declared_minimums()) as env:
        yield {**env, "wheel": wheel}


def test_version_names_what_is_installed_and_two_ranks_train(oldest):
    check_versions_and_two_ranks(oldest, oldest=True)
