"""The model and where its weights come from.

model    open_clip models made ready for a DeepSpeed engine: built, locked, image flags applied, tokenizer
weights  one decision per start: published weights, a tower's own, a teacher, or a checkpoint to resume
"""
