"""Hugging Face interop: import (train.init_from), export (action=export) and generate (action=generate).

Pure-Python modules (no torch; the launcher reads them before a launch): hf_config (config.json <-> ModelConfig),
names (the Hugging Face tensor names and shapes of a model), safetensors_index (which file holds which tensor,
from the safetensors headers), tokenizer_files. Torch modules: convert (the tensor mapping both ways),
init_from (per-rank slices), checkpoint_reader (full parameters of a meshrun checkpoint), export, generate.
"""
