"""Evaluation: val loss, image<->text retrieval and zero-shot classification, on the engine or an export.

    ds-clip-eval OUT --val-data synthetic --zeroshot-classes classes.json      # an exported folder
    ds-clip-eval ViT-B-32 --pretrained OUT/open_clip_model.safetensors --val-data 'val/{0..3}.tar'
    ds-clip-eval ViT-B-32 --pretrained laion2b_s34b_b79k --val-data ...      # an open_clip tag (docs/pretrained.md)

During training (``--val-data``, ``--val-every-n-steps``) every rank takes part: rank r embeds the
samples with index i = r (mod W), the embeddings are gathered with their indices, so every sample
counts exactly once whatever W is, and every rank runs the same number of forward passes (ZeRO-3
gathers parameters in forward: a rank that ran out of samples repeats a padding batch).

Metrics are over the whole validation set at once, so they do not depend on W or the batch size:
- ``val_loss``: the CLIP (or SigLIP) loss of all N_val pairs as one batch;
- ``i2t_R@{1,5,10}``, ``t2i_R@{1,5,10}``, ``*_median_rank`` (1-based): the rank of the true partner
  among all N_val candidates; ties are broken by sample index (as a stable sort would), so a model
  that maps everything to one point scores chance, not 100%;
- ``zeroshot_top1`` / ``zeroshot_top5``: class = argmax of the image against the mean of the
  normalised template embeddings of each class (open_clip's classifier). A sample's label is its
  webdataset ``cls`` (integer) if present, else the one class name found as whole words in its caption;
  samples with no or several matches are left out (``zeroshot_samples`` says how many count).

``--val-data synthetic`` renders held-out pairs of the built-in dataset (indices from 2**40 on, which
training never reaches); webdataset shards are read in order, undecoded samples of other ranks skipped.

The package by role, each module importing only from those below it (an import-linter contract):
``cli`` (ds-clip-eval) | ``evaluator`` (the trainer's cadence) -> ``runner`` (one evaluation, a collective)
-> ``zeroshot`` (classifiers, class-folder zero-shot) | ``reporting`` (log line, CSV, JSON) | ``inputs`` (every
input checked before the first step) -> ``datasets`` (what a rank reads) -> ``classes`` (class names,
templates) | ``metrics`` (pure functions) | ``agreement`` (the ranks agree that an evaluation failed) ->
``settings``. ``ds_clip.evaluate`` names what the trainer, ds-clip-eval and users need (below); the metrics,
class names, classifiers and reporting are imported from their modules.
"""

from ds_clip.evaluate.cli import SHARED_FLAGS, build_parser, main
from ds_clip.evaluate.datasets import iter_val_batches
from ds_clip.evaluate.evaluator import Evaluator
from ds_clip.evaluate.inputs import check_train_inputs, check_val_data
from ds_clip.evaluate.runner import engine_forward, evaluate, run_on_engine
from ds_clip.evaluate.settings import EvalError, EvalFailed, EvalSettings, Forward
from ds_clip.evaluate.zeroshot import folder_task, imagenet_tasks

__all__ = [
    "SHARED_FLAGS",
    "EvalError",
    "EvalFailed",
    "EvalSettings",
    "Evaluator",
    "Forward",
    "build_parser",
    "check_train_inputs",
    "check_val_data",
    "engine_forward",
    "evaluate",
    "folder_task",
    "imagenet_tasks",
    "iter_val_batches",
    "main",
    "run_on_engine",
]
