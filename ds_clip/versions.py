"""The versions ds_clip runs with: ``ds-clip-train --version`` prints them, and every start logs them once (the
first line to paste into a bug report).

Read from the installed distributions' metadata (``importlib.metadata``), so asking costs no import of torch.
"""

from __future__ import annotations

import platform
from importlib import metadata

# (the name shown, the distribution on the package index); ds_clip itself comes first.
PACKAGES = (
    ("ds_clip", "ds_clip"),
    ("torch", "torch"),
    ("deepspeed", "deepspeed"),
    ("open_clip", "open_clip_torch"),
    ("webdataset", "webdataset"),
    ("huggingface_hub", "huggingface_hub"),
    ("transformers", "transformers"),
)


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _ds_clip_version() -> str:
    # A checkout run without installing (PYTHONPATH) has no distribution metadata: the package's own number.
    from ds_clip import __version__

    return installed_version("ds_clip") or __version__


def versions() -> dict[str, str]:
    """Each package's version ("not installed" for an optional one that is missing), then Python's."""
    out = {"ds_clip": _ds_clip_version()}
    for shown, dist in PACKAGES[1:]:
        out[shown] = installed_version(dist) or "not installed"
    out["python"] = platform.python_version()
    return out


def versions_line() -> str:
    """One line: ``ds_clip 0.1.0 | torch 2.14.1 | ... | python 3.11.7``."""
    return " | ".join(f"{name} {v}" for name, v in versions().items())
