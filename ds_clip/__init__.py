"""ds_clip: DeepSpeed trainer for CLIP-style models with exact cached-feature accumulation."""

__version__ = "0.1.0"
