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
    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """safetensors dtype code (F32, BF16, F16, ...)."""
    key: str = ""
    """Its name in the file (with or without the class prefix, see names.hf_name)."""


# Bytes per element of the safetensors dtypes (its format's list); weights are read only from the float ones.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


def _check_entries(path: str, header: dict[str, dict]) -> None:
    """Every entry well formed (a known dtype, a shape, offsets that hold exactly its bytes) and no two
    entries' byte ranges overlapping: a crafted or damaged header is an HFError naming the file, never a
    traceback or two tensors read from the same bytes."""
    ranges = []
    for key, meta in header.items():
        try:
            dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in [*shape, begin, end]):
                raise ValueError("negative or non-integer sizes")
        except (KeyError, TypeError, ValueError) as exc:
            raise HFError(
                f"{path}: the header entry of {key!r} is malformed ({exc}); the file is damaged or not "
                f"safetensors: download it again"
            ) from None
        if dtype not in DTYPE_BYTES:
            raise HFError(
                f"{path}: {key!r} has dtype {dtype!r}, which safetensors does not define; download the file again"
            )
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * DTYPE_BYTES[dtype]:
            raise HFError(
                f"{path}: {key!r} claims bytes {begin}..{end} for {count} {dtype} values "
                f"({count * DTYPE_BYTES[dtype]} bytes); the header is damaged: download the file again"
            )
        ranges.append((begin, end, key))
    ranges.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise HFError(
                f"{path}: {k0!r} and {k1!r} overlap (bytes {b0}..{e0} and {b1}..{e1}); the header is "
                f"damaged or crafted: download the file again"
            )


def read_header(path: str) -> dict[str, dict]:
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
    if not isinstance(header, dict):
        raise HFError(f"{path} has a header that is not a JSON object; it is not a safetensors file: download it again")
    header.pop("__metadata__", None)
    _check_entries(path, header)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise HFError(f"{path} is truncated ({size} bytes, its header needs {8 + n + end}); download it again")
    return header


def index_tensors(directory: str) -> dict[str, TensorEntry]:
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
        hint = (
            f" (it holds {', '.join(other[:3])}: load it with transformers and save it again with "
            f"save_pretrained, which writes safetensors)"
            if other
            else ""
        )
        raise HFError(f"{directory} has neither {SINGLE} nor {INDEX}: meshrun reads safetensors weights{hint}")
    out: dict[str, TensorEntry] = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise HFError(
                f"{path} is missing: {INDEX} names it as a shard of the model; download every file "
                f"the index names into {directory}"
            )
        for key, meta in read_header(path).items():
            if weight_map is None or weight_map.get(key) == name:
                out[key] = TensorEntry(path, tuple(int(v) for v in meta["shape"]), str(meta["dtype"]), key)
    if weight_map is not None:
        lost = sorted(k for k in weight_map if k not in out)
        if lost:
            raise HFError(
                f"{os.path.join(directory, weight_map[lost[0]])} lacks {len(lost)} tensor(s) {INDEX} "
                f"puts there (first: {lost[0]}); download that shard again"
            )
    return out


def check_tensors(directory: str, mc, family: str) -> dict[str, TensorEntry]:
    """The tensors of `directory` by their expected names; every missing tensor or wrong shape is one HFError
    that lists them all (shapes come from config.json, so a mismatch means the two disagree)."""
    tensors = index_tensors(directory)
    problems: list[str] = []
    found: dict[str, TensorEntry] = {}
    for name, shape in expected_shapes(mc, family).items():
        key = hf_name(name, family, tensors)
        if key is None:
            problems.append(f"{name} is missing")
            continue
        entry = tensors[key]
        if entry.dtype not in WEIGHT_DTYPES:
            problems.append(
                f"{os.path.basename(entry.file)}: {key} is {entry.dtype}, not a floating-point weight "
                f"({', '.join(WEIGHT_DTYPES)})"
            )
        if entry.shape != tuple(shape):
            problems.append(
                f"{os.path.basename(entry.file)}: {key} has shape {list(entry.shape)}, "
                f"config.json implies {list(shape)}"
            )
        found[name] = entry
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise HFError(
            f"the weights in {directory} do not match its config.json: {'; '.join(problems[:8])}{more}; "
            f"use the config.json that was saved with these weights (or download the model again)"
        )
    return found
