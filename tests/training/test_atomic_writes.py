"""The one atomic-write helper (training/contract/rundir/files.py): every whole-file or whole-directory
replacement in the product goes through it, and its helpers leave the old or the new content, never a mix or
a stray temporary file."""

import os
import pathlib
import re

import pytest

from training.contract.rundir.files import atomic_path, replace_dir, symlink_atomic

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/training/this file
OWNER = ROOT / "training" / "contract" / "rundir" / "files.py"


def test_no_module_but_the_helper_renames_files_itself():
    found = []
    for package in ("launcher", "training", "hydra_plugins"):
        for path in (ROOT / package).rglob("*.py"):
            if path == OWNER:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bos\.(replace|rename)\(", line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_atomic_path_renames_on_success_and_removes_the_temporary_on_error(tmp_path):
    target = tmp_path / "plot.png"
    target.write_text("old")
    with atomic_path(str(target), suffix=".png", fsync=True) as tmp:
        assert tmp.endswith(".png") and tmp != str(target)
        pathlib.Path(tmp).write_text("new")
        assert target.read_text() == "old"  # not visible before the block ends
    assert target.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as tmp:
            pathlib.Path(tmp).write_text("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["plot.png"]


def test_replace_dir_swaps_a_full_directory_whole(tmp_path):
    target, new = tmp_path / "code", tmp_path / "code.tmp"
    target.mkdir()
    (target / "a.py").write_text("old")
    new.mkdir()
    (new / "b.py").write_text("new")
    replace_dir(str(new), str(target))
    assert sorted(os.listdir(target)) == ["b.py"] and sorted(os.listdir(tmp_path)) == ["code"]
    other = tmp_path / "fresh.tmp"
    other.mkdir()
    replace_dir(str(other), str(tmp_path / "fresh"))  # no old directory: one rename
    assert sorted(os.listdir(tmp_path)) == ["code", "fresh"]


def test_symlink_atomic_repoints_a_link_and_leaves_no_temporary(tmp_path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run2").mkdir()
    link = tmp_path / "latest"
    symlink_atomic("run1", str(link))
    symlink_atomic("run2", str(link))
    assert os.readlink(link) == "run2" and sorted(os.listdir(tmp_path)) == ["latest", "run1", "run2"]
