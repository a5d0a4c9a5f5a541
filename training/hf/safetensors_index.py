"""Which file of a Hugging Face directory holds which tensor, with its shape and dtype (pure Python).

A safetensors file starts with an 8-byte little-endian header length and a JSON header that lists every
tensor's dtype, shape and byte range, so shapes and missing files are checked here, in the launcher, before
any rank starts. A sharded model has `model.safetensors.index.json` whose `weight_map` names each tensor's file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Dict, List, Tuple

from training.hf.hf_config import HFError
from training.hf.names import expected_shapes, hf_name

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Headers are small (a few MB even for 70B models); a larger claim means the file is not safetensors.
_MAX_HEADER = 100 * 2**20


@dataclass
class TensorEntry:
    """One tensor of a safetensors checkpoint."""

    file: str
    """Absolute path of the file that holds it."""
    shape: Tuple[int, ...]
    """Its shape."""
    dtype: str
    """safetensors dtype code (F32, BF16, F16, ...)."""
    key: str = ""
    """Its name in the file (with or without the class prefix, see names.hf_name)."""


def read_header(path: str) -> Dict[str, dict]:
    """The JSON header of a safetensors file (without `__metadata__`)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as exc:
        raise HFError(f"{path} is not a readable safetensors file ({exc}); download it again") from exc
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise HFError(f"{path} is truncated ({size} bytes, its header needs {8 + n + end}); download it again")
    return header


def index_tensors(directory: str) -> Dict[str, TensorEntry]:
    """Every tensor of the model in `directory`; a missing or unreadable shard is an HFError naming it."""
    index_path = os.path.join(directory, INDEX)
    single = os.path.join(directory, SINGLE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFError(f"{index_path} cannot be read ({exc}); download it again") from exc
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
        weight_map, files = None, [SINGLE]
    else:
        other = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack")))
        hint = (f" (it holds {', '.join(other[:3])}: load it with transformers and save it again with "
                f"save_pretrained, which writes safetensors)" if other else "")
        raise HFError(f"{directory} has neither {SINGLE} nor {INDEX}: meshrun reads safetensors weights{hint}")
    out: Dict[str, TensorEntry] = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise HFError(f"{path} is missing: {INDEX} names it as a shard of the model; download every file "
                          f"the index names into {directory}")
        for key, meta in read_header(path).items():
            if weight_map is None or weight_map.get(key) == name:
                out[key] = TensorEntry(path, tuple(int(v) for v in meta["shape"]), str(meta["dtype"]), key)
    if weight_map is not None:
        lost = sorted(k for k in weight_map if k not in out)
        if lost:
            raise HFError(f"{os.path.join(directory, weight_map[lost[0]])} lacks {len(lost)} tensor(s) {INDEX} "
                          f"puts there (first: {lost[0]}); download that shard again")
    return out


def check_tensors(directory: str, mc, family: str) -> Dict[str, TensorEntry]:
    """The tensors of `directory` by their expected names; every missing tensor or wrong shape is one HFError
    that lists them all (shapes come from config.json, so a mismatch means the two disagree)."""
    tensors = index_tensors(directory)
    problems: List[str] = []
    found: Dict[str, TensorEntry] = {}
    for name, shape in expected_shapes(mc, family).items():
        key = hf_name(name, family, tensors)
        if key is None:
            problems.append(f"{name} is missing")
            continue
        entry = tensors[key]
        if entry.shape != tuple(shape):
            problems.append(f"{os.path.basename(entry.file)}: {key} has shape {list(entry.shape)}, "
                            f"config.json implies {list(shape)}")
        found[name] = entry
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise HFError(f"the weights in {directory} do not match its config.json: {'; '.join(problems[:8])}{more}; "
                      f"use the config.json that was saved with these weights (or download the model again)")
    return found
