"""action=export and action=generate read a checkpoint through the same restricted reader as a resume
(training/hf/checkpoint_reader.py, SafeFileSystemReader): a `.metadata` that re-declares a weight as a DCP
"bytes" entry pointing at a pickle is refused, and the pickle never runs (tests audit 2026-12-03, §6.13: only
the resume path was tested). One tiny run in this process (one rank, no spawn)."""

from __future__ import annotations

import os
import pickle

import pytest
from helpers.checkpoint import RunsCommand, reseal
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from training.checkpoint import CheckpointError, storage
from training.contract.config import Config, GenerateConfig


def _tiny(run_dir: str) -> None:
    from training.parallel.mesh import ProcessMesh
    from training.run.loop import Trainer

    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 16, 2, 8, 64
    p = cfg.parallel
    p.tp, p.pp, p.dp, p.sp, p.zero, p.micro_batch, p.global_batch = 1, 1, 1, False, 0, 1, 1
    cfg.cluster.gpus_per_node, cfg.cluster.peak_tflops = 1, 1.0
    t = cfg.train
    t.steps, t.warmup_steps, t.progress, t.tensorboard = 1, 1, False, False
    cfg.data.kind = "synthetic"
    cfg.run.dir = run_dir
    assert Trainer(cfg, run_dir, ProcessMesh.single()).run() == 0


def _plant_bytes_entry(step_path: str, canary: str) -> None:
    """The first model weight re-declared as bytes, pointing at a pickle appended to a shard; manifest resealed."""
    meta_path = os.path.join(step_path, storage.DCP_METADATA)
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # genuine metadata written by DCP
    key = sorted(k for k in metadata.state_dict_metadata if k.startswith("model/"))[0]
    shard = sorted(n for n in os.listdir(step_path) if n.endswith(".distcp"))[0]
    payload = pickle.dumps(RunsCommand(f"touch {canary}"))
    offset = os.path.getsize(os.path.join(step_path, shard))
    with open(os.path.join(step_path, shard), "ab") as f:
        f.write(payload)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo(relative_path=shard, offset=offset, length=len(payload))
    with open(meta_path, "wb") as f:
        pickle.dump(metadata, f)
    reseal(step_path)


def test_export_and_generate_refuse_a_bytes_entry_and_run_nothing(tmp_path):
    from training.hf.export import export
    from training.hf.generate import run as generate

    run = str(tmp_path / "run")
    _tiny(run)
    export(run, str(tmp_path / "good"))  # the untouched checkpoint exports
    assert os.path.exists(tmp_path / "good" / "config.json")
    canary = tmp_path / "canary"
    step = storage.step_dir(run, storage.read_latest(run))
    _plant_bytes_entry(step, str(canary))
    assert storage.verify(step).ok  # the manifest matches: only the reader stands in the way
    with pytest.raises(CheckpointError) as err:
        export(run, str(tmp_path / "out"))
    assert "BytesStorageMetadata" in str(err.value) and "nothing in it ran" in str(err.value), err.value
    assert not canary.exists() and not os.path.exists(tmp_path / "out" / "config.json")
    with pytest.raises(CheckpointError) as err:
        generate(run, GenerateConfig(prompt_tokens=[1, 2, 3], max_new_tokens=2))
    assert "BytesStorageMetadata" in str(err.value) and "nothing in it ran" in str(err.value), err.value
    assert not canary.exists()
