"""The model layer: glm5_next trunk, its native MTP layer, the hybrid trunk cache, checkpoints and the
tokenizer. Pure torch (no engine, no Triton); runs inside the ``trunk`` and drafter processes and in tools."""
