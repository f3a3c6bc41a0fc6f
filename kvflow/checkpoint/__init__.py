"""Checkpoint formats -> named tensors: an HF folder's safetensors files, GGUF files (and their
block formats), compressed-tensors int8 checkpoints, and the cache of a GGUF file's conversion.
The model's family (kvflow/models/) names and fuses what is read; kvflow/model/ loads it."""
