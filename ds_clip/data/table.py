"""CSV/TSV training data as open_clip reads it: one row per pair, an image path column and a caption column.

`read_table` reads the file once at start-up with Python's csv module (open_clip uses pandas.read_csv with
the same columns, separator and quoting: a header row, '"' quotes). `CsvPairs` is the map-style dataset the
step loader (data/loader.py) indexes by *position in the epoch*: position p of epoch e is row order_e[p],
order_e a permutation of all rows seeded by (seed, e). So a step's pairs are a function of (seed, epoch,
step, N = W*k*m) alone, like the synthetic data's, and every row is trained once per epoch.

A row whose image is missing on disk or cannot be decoded (or whose caption is empty) is a per-sample
problem, not a start-up error: it is counted once, at its own position (`skip_counts`, reasons as for
webdataset), and replaced by the next row of the epoch's order that loads (positions p+1, p+2, ...
wrapping around), so every micro-batch still has m pairs and the epoch its exact number of steps. The replacement is a function of
(seed, epoch, p), so it is the same on every rank, worker count and restart. See docs/data.md.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from ds_clip.data.augment import SeededTransform
from ds_clip.data.base import DataError

_STARTUP_PROBE_ROWS = 64  # rows whose image paths are looked at before training: all missing -> an error
_MAX_REPLACEMENTS = 1000  # consecutive rows of an epoch's order that fail to load -> an error, not a scan
_SEPARATOR_HINTS = (",", "\t", ";", "|")

Report = tuple[str, str]
"""(skip reason, message) of a row that was replaced."""


def separator_char(separator: str) -> str:
    """--csv-separator as the csv module takes it: the two characters backslash-t mean a tab (pandas, which
    open_clip uses, reads that regular expression as a tab too)."""
    return "\t" if separator == "\\t" else separator


def read_table(
    path: str, img_key: str, caption_key: str, separator: str, flag: str = "--train-data"
) -> tuple[list[str], list[str]]:
    """(image paths, captions) of every row of the file, in file order. Raises DataError naming the flag
    (``flag``: --train-data, or --val-data for a validation table)."""
    sep = separator_char(separator)
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path!r}: no such CSV/TSV file")
    paths: list[str] = []
    captions: list[str] = []
    try:
        # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark, which would otherwise stick to the
        # first column's name (pandas, which open_clip uses, drops it too).
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f, delimiter=sep)
            header = reader.fieldnames
            if not header:
                raise DataError(f"{flag} {path!r} is empty: it needs a header row naming the columns")
            _check_columns(path, header, img_key, caption_key, separator)
            for row in reader:
                image, caption = row.get(img_key), row.get(caption_key)
                if image is None or caption is None or None in row:
                    raise DataError(
                        f"{flag} {path!r} line {reader.line_num}: not as many fields as the header's "
                        f"{len(header)} columns (--csv-separator {separator!r}; quote fields that contain it)"
                    )
                paths.append(image)
                captions.append(caption)
    except UnicodeDecodeError as exc:
        raise DataError(f"{flag} {path!r} is not UTF-8 text: {exc}") from None
    except csv.Error as exc:
        raise DataError(
            f"{flag} {path!r}: not readable as CSV with --csv-separator {separator!r}: {exc}"
        ) from None
    return paths, captions


def _check_columns(path: str, header: list[str], img_key: str, caption_key: str, separator: str) -> None:
    for flag, key in (("--csv-img-key", img_key), ("--csv-caption-key", caption_key)):
        if key in header:
            continue
        if len(header) == 1:
            other = [c for c in _SEPARATOR_HINTS if c in header[0] and c != separator_char(separator)]
            if other:
                raise DataError(
                    f"--csv-separator {separator!r}: the header of {path!r} is one column {header[0]!r}; "
                    f"it looks {other[0]!r}-separated (open_clip's default separator is a tab)"
                )
        raise DataError(f"{flag} {key!r}: {path!r} has no such column (its columns: {', '.join(header)})")


def check_image_paths(path: str, paths: list[str]) -> None:
    """An error when none of the first rows' images exist: a path problem, not bad samples (relative paths
    are relative to the working directory, as in open_clip)."""
    probe = paths[:_STARTUP_PROBE_ROWS]
    if not probe or any(os.path.isfile(p) for p in probe):
        return
    hint = ""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isabs(probe[0]) and os.path.isfile(os.path.join(folder, probe[0])):
        hint = f"; they exist relative to the file's folder: run from {folder} or write absolute paths"
    raise DataError(
        f"--csv-img-key: none of the first {len(probe)} image paths of {path!r} exists (first: {probe[0]!r}; "
        f"relative paths are taken from the working directory {os.getcwd()}){hint}"
    )


def epoch_order(seed: int, epoch: int, rows: int) -> np.ndarray:
    """Permutation of the rows for (seed, epoch). numpy's legacy RandomState: its stream is frozen across
    numpy versions (a resumed run after an upgrade still sees the same order)."""
    digest = hashlib.blake2b(repr(("csv-order", int(seed), int(epoch))).encode(), digest_size=16).digest()
    return np.random.RandomState(np.frombuffer(digest, dtype=np.uint32)).permutation(rows)


class CsvPairs(torch.utils.data.Dataset):
    """`dataset[p]` = (image tensor, tokens, reports) of position p of epoch `epoch`'s row order.

    Reports list the rows replaced to get there (see the module docstring). The row's augmentation is
    drawn from (seed, epoch, row index) by the SeededTransform. The order is computed where the dataset
    runs (in each worker), cached for the current epoch: only the two columns travel to the workers.
    """

    def __init__(
        self,
        *,
        paths: list[str],
        captions: list[str],
        seed: int,
        preprocess: SeededTransform,
        tokenizer: Callable[[list[str]], Any],
        epoch: int = 0,
    ) -> None:
        self.paths, self.captions = paths, captions
        self.seed, self.preprocess, self.tokenizer, self.epoch = seed, preprocess, tokenizer, epoch
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.seed, self.epoch, len(self.paths)))
        return self._order[1]

    def load(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[str, str]:
        """The pair of one row, or (skip reason, detail)."""
        path, caption = self.paths[row], self.captions[row]
        if not caption.strip():
            return "missing_caption", "empty caption"
        try:
            with Image.open(path) as im:
                image = im.convert("RGB")  # forces the full decode: a broken file fails here, not later
        except FileNotFoundError:
            return "missing_image", "no such file"
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean "undecodable"
            return "bad_image", f"{type(exc).__name__}: {exc}"
        # preprocess/tokenizer errors are bugs, not bad data: let them propagate
        pixels = self.preprocess(image, epoch=self.epoch, sample=row)
        return pixels, torch.as_tensor(self.tokenizer([caption])[0])

    def __getitem__(
        self, position: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[Report]] | tuple[None, None, list[Report]]:
        order = self.order()
        rows = len(order)
        reports: list[Report] = []
        tries = min(rows, _MAX_REPLACEMENTS + 1)
        for j in range(tries):
            row = int(order[(position + j) % rows])
            out = self.load(row)
            if isinstance(out[0], torch.Tensor):
                return out[0], out[1], reports
            if j == 0:
                # Counted at its own position only: a bad row met again as a candidate replacement is counted
                # where the epoch trains it (or not at all when it lies in the left-out tail of the order).
                reason, detail = out
                reports.append((reason, f"skipped {reason} in row {row} ({self.paths[row]!r}): {detail}"))
        reports.append(
            ("fatal", f"no loadable row among {tries} consecutive rows of epoch {self.epoch}'s order")
        )
        return None, None, reports


__all__ = ["CsvPairs", "Report", "check_image_paths", "epoch_order", "read_table", "separator_char"]
