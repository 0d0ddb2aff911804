"""Taking a trained run elsewhere (``ds-clip-export``, ``python -m ds_clip.export``).

openclip    the command, and open_clip's format: consolidated fp32 weights in open_clip's names and shapes
hf_clip     the transformers format: CLIPModel, tokenizer, processor
hf_siglip   the transformers format of SigLIP-architecture models: SiglipModel
hf_towers   what the two transformers exports share
model_card  the README.md every export folder carries
"""
