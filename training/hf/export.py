"""`python -m training.hf.export RUN_DIR --output DIR [--step N] [--dtype auto] [--max-shard-mb M]`
(what `meshrun action=export` runs): a checkpoint of the run as a Hugging Face model directory.

Reads the full parameters on this one process (training/hf/checkpoint_reader.py: any tp / pp / dp / zero /
precision), converts them (training/hf/convert.py), and writes config.json, generation_config.json, the
safetensors weights (split into shards with model.safetensors.index.json above --max-shard-mb) and the run's
tokenizer files, all into a temporary directory beside DIR that is renamed to DIR only when complete. Prints
one JSON object on stdout. Exit 2 for anything the user can fix (no checkpoint, DIR exists, a model no
Hugging Face class expresses), with the file or key and the fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from typing import Any

from training.contract.rundir.files import rename_into_place
from training.hf.cli_result import print_result

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def shard_plan(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names per file, in order: a new file starts when the next tensor would pass max_bytes."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def _umask_mode() -> int:
    """0666 less this process's umask: the mode every other file of a run gets."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_weights(tensors: dict[str, Any], directory: str, max_bytes: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json; returns the files.
    safetensors creates its files 0600: they get the umask's mode, as every other file meshrun writes."""
    from safetensors.torch import save_file as _save_file

    def save_file(part, path, metadata):
        _save_file(part, path, metadata=metadata)
        os.chmod(path, _umask_mode())

    from training.hf.safetensors_index import INDEX, SINGLE

    names = sorted(tensors)
    plan = shard_plan([(n, tensors[n].numel() * tensors[n].element_size()) for n in names], max_bytes)
    if len(plan) == 1:
        save_file({n: tensors[n] for n in plan[0]}, os.path.join(directory, SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files, weight_map = [], {}
    for i, group in enumerate(plan):
        fname = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(directory, fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({n: fname for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return files + [INDEX]


def export(run_dir: str, output: str, step=None, dtype: str = "auto", max_shard_mb: float = 5000.0) -> dict:
    """Write the Hugging Face directory; returns what the command prints."""
    import torch

    from training.hf.checkpoint_reader import read_checkpoint
    from training.hf.convert import to_hf
    from training.hf.hf_config import CLASS_OF, HFError, family_for_model, hf_config_from_model
    from training.hf.tokenizer_files import write_tokenizer_files

    if not output:
        raise HFError("export.output is not set: give the directory to write, export.output=DIR")
    output = os.path.abspath(output)
    for path in (output, os.path.dirname(output)):
        if os.path.islink(path) and (path == output or not os.path.exists(path)):
            raise HFError(
                f"export.output={output}: {path} is a symbolic link"
                f"{'' if os.path.exists(path) else ' to nothing'}; meshrun writes an export only to a new "
                f"directory: choose a new export.output (or remove the link)"
            )
    if os.path.exists(output):
        raise HFError(
            f"export.output={output} already exists: meshrun never writes over a directory; choose a new "
            f"export.output (or remove that one)"
        )
    if max_shard_mb <= 0:
        raise HFError(f"export.max_shard_mb={max_shard_mb}: use a positive size in MiB")
    cfg, step, full = read_checkpoint(run_dir, step, "export.step", masters=dtype == "fp32")
    family = family_for_model(cfg.model)
    tensors = to_hf(full, cfg.model, family)
    target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if target is not None:
        tensors = {k: v.to(target) for k, v in tensors.items()}
    written = {v.dtype for v in tensors.values()}
    dtype_name = str(next(iter(written))).replace("torch.", "") if len(written) == 1 else "float32"
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp_{os.path.basename(output)}_{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        token_ids = write_tokenizer_files(cfg, tmp)
        hf_cfg = hf_config_from_model(cfg.model, family, dtype_name, token_ids)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2, sort_keys=True)
        gen = {k: v for k, v in token_ids.items() if v is not None}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2, sort_keys=True)
        files = write_weights(tensors, tmp, int(max_shard_mb * 2**20))
        rename_into_place(tmp, output)  # complete, or not there at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "output": output,
        "run_dir": run_dir,
        "step": step,
        "architecture": CLASS_OF[family],
        "dtype": dtype_name,
        "tensors": len(tensors),
        "files": sorted(os.listdir(output)),
        "weight_files": files,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.hf.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--output", required=True)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    ap.add_argument("--max-shard-mb", type=float, default=5000.0)
    args = ap.parse_args(argv)

    return print_result(
        lambda: export(os.path.abspath(args.run_dir), args.output, args.step, args.dtype, args.max_shard_mb)
    )


if __name__ == "__main__":
    sys.exit(main())
