"""Whether a directory lies on a file system every node of a multi-node job sees (checked before submission).

The file system is the one /proc/self/mounts names for the directory's longest mount-point prefix (the directory
itself may not exist yet: its nearest existing parent is looked up). Network and parallel file systems (NFS,
Lustre, GPFS, BeeGFS, CephFS, ...) are shared; ext4, xfs, btrfs, tmpfs and overlay are a node's own disk or memory.
No torch.
"""

from __future__ import annotations

import os

SHARED_TYPES = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cephfs",
    "ceph",
    "glusterfs",
    "fuse.glusterfs",
    "fuse.sshfs",
    "cifs",
    "smb3",
    "wekafs",
    "fuse.weka",
    "panfs",
    "orangefs",
    "9p",
    "virtiofs",
    "fuse.juicefs",
    "fuse.ceph",
    "fuse.lustre",
)
MOUNTS = "/proc/self/mounts"
"""The mount table read (tests point it at a fixture)."""
LOCAL_TYPES = ("ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "vfat", "ramfs")


def _unescape(path: str) -> str:
    """/proc/mounts writes a space as \\040, a tab as \\011."""
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")


def mount_of(path: str, mounts: str | None = None) -> tuple[str, str] | None:
    """(mount point, file system type) holding path, or None when the mount table cannot be read."""
    mounts = mounts or MOUNTS
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    probe = os.path.realpath(probe)
    best = None
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point, kind = _unescape(parts[1]), parts[2]
                if probe == point or probe.startswith(point.rstrip("/") + "/") or point == "/":
                    if best is None or len(point) >= len(best[0]):
                        best = (point, kind)
    except OSError:
        return None
    return best


def shared_verdict(path: str, mounts: str | None = None) -> tuple[bool | None, str]:
    """(True: shared, False: node-local, None: unknown type or table) and the mount it is on."""
    found = mount_of(path, mounts)
    if found is None:
        return None, "the mount table is unreadable"
    point, kind = found
    where = f"{point} ({kind})"
    if kind in SHARED_TYPES or kind.startswith("nfs"):
        return True, where
    if kind in LOCAL_TYPES:
        return False, where
    return None, where
