"""ds-clip-fetch: fill the cache with the published files a run needs, where the hub is reachable (a login node),
for runs on air-gapped nodes (HF_HUB_OFFLINE=1) that read only that cache.

    python -m ds_clip.fetch --model ViT-B-32 --pretrained laion2b_s34b_b79k [--cache-dir DIR]
    python -m ds_clip.fetch --model hf-hub:timm/ViT-B-16-SigLIP
    python -m ds_clip.fetch --model ViT-B-32 --pretrained laion2b_s34b_b79k --dry-run    (list, fetch nothing)

The files are fetched by open_clip's own loaders (ds_clip.sources.hub.fetch) into --cache-dir or huggingface_hub's cache
(HF_HUB_CACHE); each is listed with its path. The flags are ds-clip-train's own.
"""

from __future__ import annotations

import argparse
import sys

from ds_clip.config import SettingsError, add_flags
from ds_clip.config.model_checks import check_pretrained
from ds_clip.errors import UserError

FLAGS = ("model", "pretrained", "cache_dir", "pretrained_image", "distill_model", "distill_pretrained")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds-clip-fetch",
        description="Fetch the published weights, configs and tokenizers a run of these flags needs into the cache.",
    )
    add_flags(p, FLAGS)
    p.add_argument(
        "--dry-run", action="store_true", help="list the files and whether each is cached; fetch none"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from ds_clip.sources import hub

        for model, pretrained, flag in (
            (args.model, args.pretrained, "--pretrained"),
            (args.distill_model, args.distill_pretrained, "--distill-pretrained"),
        ):
            if model and pretrained:
                check_pretrained(pretrained, flag, model=model)

        def needs_now() -> list[hub.Need]:
            return hub.run_needs(
                args.model, args.pretrained, cache_dir=args.cache_dir, pretrained_image=args.pretrained_image,
                distill_model=args.distill_model, distill_pretrained=args.distill_pretrained,
            )[0]  # fmt: skip

        if args.dry_run:
            needs = needs_now()
        else:
            if hub.is_offline():
                raise hub.HubError(
                    "HF_HUB_OFFLINE is set: unset it to fetch (run this where the hub is reachable)"
                )
            needs = hub.fetch_all(needs_now, "python -m ds_clip.fetch " + " ".join(sys.argv[1:]))
    except (UserError, SettingsError) as exc:
        print(f"ds-clip-fetch: error: {exc}", file=sys.stderr)
        return 2
    for n in needs:
        print(n.describe())
    if not needs:
        print("nothing to fetch: these flags name no published weights, configs or tokenizers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
