"""Names of things outside the run, resolved: published files on the hub, and shard patterns.

hub   published weights, model configs and tokenizers (Hugging Face hub, URLs): the cache, fetching, offline
urls  the one shard-pattern expander: a --train-data/--val-data value -> the shards to read
"""
