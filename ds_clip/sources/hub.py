"""Published weights, model configs and tokenizers (Hugging Face hub, URLs), as open_clip loads them: which files
a model needs, whether the cache holds them, fetching them, and loading with no network call.

    needs = model_needs("ViT-B-32", "laion2b_s34b_b79k", cache_dir=None)   # what open_clip will ask for
    [n.describe() for n in needs]                                           # --dry-run's lines
    fetch(needs)                        # open_clip's own loaders fill the cache (one process per host)
    with offline():                     # then every rank builds from the cache: HF_HUB_OFFLINE semantics
        open_clip.create_model_and_transforms("ViT-B-32", pretrained="laion2b_s34b_b79k")

Nothing here downloads by itself: fetching is open_clip's ``download_pretrained`` (tags),
``download_pretrained_from_hf`` (hub repos), ``download_pretrained_from_url`` (URLs) and ``get_tokenizer`` (hub
tokenizers), and huggingface_hub's ``hf_hub_download`` for timm image towers and Hugging Face text towers, in the
order those libraries try the files. huggingface_hub writes a download to ``*.incomplete`` and renames it, so a
half-written file is never found in the cache. What this module adds is knowing the files in advance, so that
one process per host fetches them while the others wait, an air-gapped run is refused in one line before any
engine starts, and ``--dry-run`` can list them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ds_clip.errors import UserError

HF_HUB_PREFIX = "hf-hub:"
LOCAL_DIR_PREFIX = "local-dir:"
# The weights file name open_clip asks a hub repo for when the name gives none (safetensors tried first).
HF_WEIGHTS = "open_clip_pytorch_model.bin"
HF_CONFIG = "open_clip_config.json"


class HubError(UserError):
    """A published model, tag or file that cannot be used or fetched (names the flag, the repo and the file)."""


@dataclass(frozen=True)
class Need:
    """One file a model build asks for: ``repo`` (a hub repo id, or a URL) and the names open_clip tries in
    order (the first one the hub has is used), for ``flag`` ("--pretrained laion2b_s34b_b79k")."""

    flag: str
    kind: str
    """"weights" (a tag or hub repo), "config" (open_clip_config.json or a text tower's config.json),
    "tokenizer", "url" (a weights URL), "timm" (--pretrained-image's tower weights), "tag" (an open_clip tag)."""
    repo: str
    files: tuple[str, ...]
    cache_dir: str | None = None
    """The cache this file goes to (--cache-dir; None: huggingface_hub's default, HF_HUB_CACHE)."""
    tag_cfg: tuple[tuple[str, object], ...] = ()
    """For kind "tag": open_clip's pretrained config of the tag (what ``download_pretrained`` reads)."""

    def cached(self) -> str | None:
        """The local path of the first of ``files`` the cache holds completely, else None (no network call)."""
        if self.kind == "url":
            path = Path(url_cache_dir(self.cache_dir)) / self.files[0]
            return str(path) if path.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        for name in self.files:
            hit = try_to_load_from_cache(self.repo, name, cache_dir=self.cache_dir)
            if isinstance(hit, str):
                return hit
        return None

    def folder(self) -> str:
        return url_cache_dir(self.cache_dir) if self.kind == "url" else hub_cache_dir(self.cache_dir)

    def describe(self) -> str:
        where = self.cached()
        files = " or ".join(self.files)
        state = f"cached ({where})" if where else f"to fetch into {self.folder()}"
        return f"{self.flag}: {self.repo} {files}: {state}"


def hub_cache_dir(cache_dir: str | None) -> str:
    from huggingface_hub import constants

    return str(cache_dir or constants.HF_HUB_CACHE)


def url_cache_dir(cache_dir: str | None) -> str:
    # open_clip's download_pretrained_from_url default
    return str(cache_dir or os.path.expanduser("~/.cache/clip"))


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set for this process: no network call is allowed."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_published(pretrained: str | None) -> bool:
    """A --pretrained value that names something to fetch (a hub repo or a URL) rather than a local path."""
    return bool(pretrained) and (pretrained.startswith(HF_HUB_PREFIX) or "://" in pretrained)


def _weight_names(filename: str) -> tuple[str, ...]:
    """The names open_clip's download_pretrained_from_hf tries for ``filename``, in its order (a safetensors
    alternative first)."""
    from open_clip.pretrained import _get_safe_alternatives

    return (*_get_safe_alternatives(filename), filename)


def tag_cfg(model: str, tag: str) -> dict:
    """open_clip's pretrained config of ``tag`` for ``model`` ({} when ``tag`` is not one of its tags)."""
    import open_clip

    return (
        open_clip.get_pretrained_cfg(model, tag)
        if model and not model.startswith(("hf-hub:", "local-"))
        else {}
    )


def _tag_need(flag: str, cfg: dict, cache_dir: str | None) -> Need:
    # open_clip prefers the hub entry of a tag (every tag of open_clip 3.3 has one), else its URL.
    hub = cfg.get("hf_hub", "")
    frozen = tuple(sorted((k, v) for k, v in cfg.items() if isinstance(v, (str, bool, int, float, tuple))))
    if hub:
        repo, filename = os.path.split(hub)
        return Need(flag, "tag", repo, _weight_names(filename or HF_WEIGHTS), cache_dir, frozen)
    url = cfg["url"]
    return Need(flag, "url", url, (os.path.basename(url),), cache_dir, frozen)


def model_needs(
    model: str,
    pretrained: str | None,
    *,
    cache_dir: str | None = None,
    pretrained_image: bool = False,
    load_weights: bool = True,
    model_flag: str = "--model",
    pretrained_flag: str = "--pretrained",
) -> list[Need]:
    """Every published file building ``model`` with ``pretrained`` asks for, in the order open_clip asks.
    ``load_weights`` False (a resumed run: its checkpoint holds the weights): configs and tokenizers only.
    Raises HubError for a tag the model does not have."""
    needs: list[Need] = []
    model_cfg: dict | None = None
    whole_weights = False
    if model.startswith(HF_HUB_PREFIX):
        repo = model[len(HF_HUB_PREFIX) :]
        flag = f"{model_flag} {model}"
        config = Need(flag, "config", repo, (HF_CONFIG,), cache_dir)
        needs.append(config)
        if load_weights:
            needs.append(Need(flag, "weights", repo, _weight_names(HF_WEIGHTS), cache_dir))
            whole_weights = True
        path = config.cached()
        model_cfg = json.loads(Path(path).read_text()).get("model_cfg") if path else None
    elif model.startswith(LOCAL_DIR_PREFIX):
        from open_clip.factory import _find_checkpoint_in_dir

        folder = Path(model[len(LOCAL_DIR_PREFIX) :]).expanduser()
        path = folder / HF_CONFIG
        model_cfg = json.loads(path.read_text()).get("model_cfg") if path.is_file() else None
        # open_clip loads the folder's own weights when it has some (its tokenizer is in the folder too)
        whole_weights = folder.is_dir() and _find_checkpoint_in_dir(folder) is not None
    else:
        import open_clip

        model_cfg = open_clip.get_model_config(model)
        if pretrained and load_weights:
            flag = f"{pretrained_flag} {pretrained}"
            cfg = tag_cfg(model, pretrained)
            if cfg:
                needs.append(_tag_need(flag, cfg, cache_dir))
            elif pretrained.startswith(HF_HUB_PREFIX):
                needs.append(
                    Need(
                        flag,
                        "weights",
                        pretrained[len(HF_HUB_PREFIX) :],
                        _weight_names(HF_WEIGHTS),
                        cache_dir,
                    )
                )
            elif "://" in pretrained:
                needs.append(Need(flag, "url", pretrained, (os.path.basename(pretrained),), cache_dir))
            elif not Path(pretrained).expanduser().exists():
                raise unknown_tag(model, pretrained, pretrained_flag)
        whole_weights = bool(pretrained)
    if model_cfg is None:
        return needs
    text_cfg, vision_cfg = model_cfg.get("text_cfg", {}), model_cfg.get("vision_cfg", {})
    flag = f"{model_flag} {model}"
    tokenizer = text_cfg.get("hf_tokenizer_name")
    if tokenizer and not model.startswith(LOCAL_DIR_PREFIX):
        needs.append(Need(flag, "tokenizer", tokenizer, ("tokenizer_config.json",), cache_dir))
    if text_cfg.get("hf_model_name"):  # a Hugging Face text tower: transformers reads its config.json
        hf_text = text_cfg["hf_model_name"]
        needs.append(Need(flag, "config", hf_text, ("config.json",)))
        if load_weights and not whole_weights:  # open_clip then starts the tower from its own weights
            needs.append(Need(flag, "weights", hf_text, ("model.safetensors", "pytorch_model.bin")))
    timm_name = vision_cfg.get("timm_model_name")
    if pretrained_image and load_weights and timm_name and not whole_weights:
        needs.append(_timm_need(timm_name))
    return needs


def _timm_need(timm_name: str) -> Need:
    import timm

    cfg = timm.models.get_pretrained_cfg(timm_name)
    repo = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
    if not repo:
        raise HubError(
            f"--pretrained-image: timm has no hub weights for the image tower {timm_name!r}; drop --pretrained-image"
        )
    # timm's load_state_dict_from_hf: model.safetensors first, then pytorch_model.bin (into HF_HUB_CACHE).
    return Need("--pretrained-image", "timm", repo, ("model.safetensors", "pytorch_model.bin"))


def unknown_tag(model: str, tag: str, flag: str = "--pretrained") -> HubError:
    import open_clip

    tags = open_clip.list_pretrained_tags_by_model(model)
    others = open_clip.pretrained.list_pretrained_models_by_tag(tag)
    if others:
        why = (
            f"{tag!r} is a tag of {', '.join(others[:6])}{' ...' if len(others) > 6 else ''}, not of {model}"
        )
    else:
        why = f"{tag!r} is neither a file nor an open_clip tag"
    have = f"{model}'s tags: {', '.join(tags)}" if tags else f"{model} has no published weights"
    return HubError(f"{flag} {tag}: {why}; {have} (open_clip.list_pretrained())")


def fetch_command(
    model: str, pretrained: str | None, cache_dir: str | None, pretrained_image: bool = False
) -> str:
    """The command that fills the cache with what a run of these flags needs (run it where the hub is reachable)."""
    words = ["python", "-m", "ds_clip.fetch", "--model", model]
    if pretrained:
        words += ["--pretrained", pretrained]
    if cache_dir:
        words += ["--cache-dir", cache_dir]
    if pretrained_image:
        words.append("--pretrained-image")
    return shlex.join(words)


def refuse_uncached(needs: list[Need], command: str) -> None:
    """Offline (HF_HUB_OFFLINE): one line naming the first file the cache lacks, the cache folder and the command
    that fills it."""
    for n in needs:
        if n.cached() is None:
            raise HubError(
                f"{n.flag}: {n.repo} {' or '.join(n.files)} is not in the cache {n.folder()} and HF_HUB_OFFLINE "
                f"forbids fetching it; fill the cache where the hub is reachable with `{command}` (and copy "
                "that folder here, or point --cache-dir / HF_HUB_CACHE at it)"
            )


def run_needs(
    model: str,
    pretrained: str | None,
    *,
    cache_dir: str | None = None,
    pretrained_image: bool = False,
    load_weights: bool = True,
    distill_model: str | None = None,
    distill_pretrained: str | None = None,
) -> tuple[list[Need], str]:
    """What a run of these flags fetches (the student's files, then the teacher's; ``load_weights`` False for a
    resumed student), and the command that fills a cache with them."""
    needs = model_needs(
        model, pretrained, cache_dir=cache_dir, pretrained_image=pretrained_image, load_weights=load_weights
    )
    command = fetch_command(model, pretrained, cache_dir, pretrained_image)
    if distill_model is not None:
        needs += model_needs(
            distill_model, distill_pretrained, cache_dir=cache_dir, model_flag="--distill-model",
            pretrained_flag="--distill-pretrained",
        )  # fmt: skip
        command += f" && {fetch_command(distill_model, distill_pretrained, cache_dir)}"
    return needs, command


def fetch_all(needs_now: Callable[[], list[Need]], command: str) -> list[Need]:
    """Fetch until the cache holds every need: an hf-hub: model's tokenizer and text tower are known only once
    its open_clip_config.json is cached, so the needs are computed again after each round. Returns them."""
    for _ in range(3):
        needs = needs_now()
        missing = [n for n in needs if n.cached() is None]
        if not missing:
            return needs
        fetch(missing, command)
    return needs_now()


def fetch(needs: list[Need], command: str) -> None:
    """Fill the cache with ``needs`` through open_clip's (and huggingface_hub's) own downloaders. Every failure
    (hub unreachable, a repo or file the hub does not have) is one HubError naming the flag, repo and file."""
    from open_clip.pretrained import (
        download_pretrained,
        download_pretrained_from_hf,
        download_pretrained_from_url,
    )

    for n in needs:
        if n.cached() is not None:
            continue
        try:
            if n.kind == "tag":
                download_pretrained(dict(n.tag_cfg), cache_dir=n.cache_dir)
            elif n.kind == "url":
                download_pretrained_from_url(n.repo, cache_dir=n.cache_dir)
            elif n.kind == "tokenizer":
                _fetch_tokenizer(n)
            elif n.kind in ("weights", "config") and n.files[-1].startswith("open_clip"):
                download_pretrained_from_hf(n.repo, filename=n.files[-1], cache_dir=n.cache_dir)
            else:
                _hf_first_of(n)
        except Exception as exc:  # whatever the client raised: one line, the user's next step
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise HubError(
                f"{n.flag}: could not fetch {n.repo} {' or '.join(n.files)} into {n.folder()} ({first}); check "
                f"the name and that the hub is reachable (HF_ENDPOINT), or fill the cache elsewhere with `{command}`"
            ) from None
        if n.cached() is None:
            raise HubError(f"{n.flag}: fetched {n.repo} but {' or '.join(n.files)} is not in {n.folder()}")


def _fetch_tokenizer(n: Need) -> None:
    # transformers' AutoTokenizer (what open_clip's HFTokenizer calls) fetches every file the tokenizer has.
    from open_clip.tokenizer import HFTokenizer

    HFTokenizer(n.repo, cache_dir=n.cache_dir)


def _hf_first_of(n: Need) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    for name in n.files[:-1]:
        try:
            hf_hub_download(n.repo, name, cache_dir=n.cache_dir)
            return
        except EntryNotFoundError:
            continue
    hf_hub_download(n.repo, n.files[-1], cache_dir=n.cache_dir)


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """HF_HUB_OFFLINE semantics inside the block, whatever the environment said at import: every hub client
    (huggingface_hub, and transformers through it) answers from the cache or fails, never calls the network.
    Restored on exit.

    ``huggingface_hub.constants.HF_HUB_OFFLINE`` is the client's documented switch (``HF_HUB_OFFLINE=1`` sets it
    at import). From huggingface_hub 1.0 every request reads it (``constants.is_offline_mode()``); before 1.0 a
    session mounted its offline adapter once, when built, so the sessions are rebuilt (``reset_sessions``, gone
    in 1.0). transformers 4.x kept its own copy of the flag (``_is_offline_mode``); 5.x reads the hub's."""
    from huggingface_hub import constants

    tf_hub = _transformers_hub()
    before = constants.HF_HUB_OFFLINE, getattr(tf_hub, "_is_offline_mode", None)
    constants.HF_HUB_OFFLINE = True
    if tf_hub is not None:
        tf_hub._is_offline_mode = True
    _reset_hub_sessions()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before[0]
        if tf_hub is not None:
            tf_hub._is_offline_mode = before[1]
        _reset_hub_sessions()


def _reset_hub_sessions() -> None:
    """huggingface_hub < 1.0 only: drop the per-thread sessions, so that the next one sees the offline flag."""
    import huggingface_hub.utils as hf_utils

    reset = getattr(hf_utils, "reset_sessions", None)
    if reset is not None:
        reset()


def _transformers_hub():
    try:
        import transformers.utils.hub as tf_hub
    except ImportError:
        return None
    return tf_hub if hasattr(tf_hub, "_is_offline_mode") else None
