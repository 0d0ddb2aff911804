"""Webdataset pipeline: tar shards of (image, caption) pairs, split so that every step is full.

Two modes (see docs/data.md):
- exact-epoch (default): the shard list is shuffled by (seed, epoch) and laid end to end; each rank
  takes a contiguous range of steps_per_epoch*k*m samples of that sequence, each of its DataLoader
  workers a contiguous, micro-batch-aligned part of that range. Every sample is read by exactly one
  worker; the < N samples at the end of the sequence that do not fill a global batch are left out
  (a different set each epoch). This needs per-shard sample counts: `sizes.json` next to the shards
  (open_clip's format, written by `ds-clip-shards`) or, failing that, a scan of the tars at start-up.
- resampled: each worker draws shards with replacement, seeded by (seed, epoch, rank, worker);
  an epoch is --train-num-samples pairs. With --train-data-upsampling-factors each shard of "::"-joined
  source i is drawn with weight factor_i (open_clip's ResampledShards2 with expand_urls' weights).

Workers shuffle undecoded samples in a seeded buffer, decode, and send micro-batches of m pairs with
their skip counts and their position (raw samples consumed) attached; the main process takes the
micro-batches round-robin starting from a fixed worker, so the order is a pure function of (seed,
epoch, rank, W, k, m, workers), and a resumed run can make every worker skip exactly what it had
consumed without decoding it.

Augmentation: the worker calls the user's transform through a SeededTransform (data/augment.py) with the
sample's identity (shard name, sample key: ds_clip.sources.urls.shard_name, the shard's last path component
whatever folder, bucket or pipe: command reaches it) and the epoch, so a sample's random crop (and any other
draw of the transform) is the same whatever rank, worker, --workers, restart or data location reads it.

Under --siglip2 (`locca_tasks`) a sample's text is [3, L]: its caption, then the ARef and GCap rows of one
region read from its json, the box following the sample's own crop (ds_clip.data.regions, docs/data.md).

Modules: ``pipeline`` (``WebDatasetTrainData``: the epoch plan, the workers, the round-robin and the resume
position) -> ``shardlist`` (shard list, weights, sizes) -> ``samples`` (reading, skipping, shuffling and
decoding the samples of one shard).
"""

from ds_clip.data.wds.pipeline import WebDatasetTrainData
from ds_clip.data.wds.samples import RawSample, SkipCounter, decode_sample, iter_shard, shuffled
from ds_clip.data.wds.shardlist import (
    SIZES_FILE,
    count_samples,
    expand_urls,
    listed_sizes,
    shard_sizes,
    shard_weights,
)

__all__ = [
    "SIZES_FILE",
    "RawSample",
    "SkipCounter",
    "WebDatasetTrainData",
    "count_samples",
    "decode_sample",
    "expand_urls",
    "iter_shard",
    "listed_sizes",
    "shard_sizes",
    "shard_weights",
    "shuffled",
]
