"""The equivalence harness: what the tests, the benchmarks and the check scripts share to train the same steps
under different splits and compare them. It lives beside ``ds_clip`` and is not installed with it (the wheel
holds what training needs); run from a checkout with the checkout on ``PYTHONPATH``.

- ``runs``: ``RunSpec`` -> ``run_in_group`` -> ``RunResult`` (generated data by global sample index, the
  ``ds-clip-train`` flags of a spec, DeepSpeed's reduced gradients, the fp32 master weights);
- ``groups``: ``spawn_group``, W local processes over gloo;
- ``oracle``: the one-process full-batch gradient and the error of a run against it;
- ``cases``: the equivalence matrix and the spec of each case;
- ``models``: tiny open_clip configs and ``local-dir:`` folders (no download).
"""
