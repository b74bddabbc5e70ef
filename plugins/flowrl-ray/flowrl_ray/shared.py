"""Is the run folder one folder for every worker? The check a Ray run makes before it builds a model.

Checkpoints live in the run folder, on a file system every node sees at the same path (NFS, Lustre,
a Kubernetes ReadWriteMany volume): rank 0 writes a model's whole weights and optimizer state there
(gathered from its group), and on resume every rank reads them back, whichever node it is on. The
probe proves it before anything is trained: the driver writes a file with a random token, every worker
reads it through the run folder's path and writes one of its own beside it, and the driver reads those
back. A worker that cannot see the driver's file, or whose file the driver cannot see, stops the run
with a ConfigError naming the worker's node and saying what to mount.

Why a shared path and not per-node shards with a manifest: flowrl's checkpoints are whole (rank 0 writes
the gathered HF weights and optimizer state; `flowrl run --resume`, `--model runs/NAME/checkpoint` and
the published checkpoint are plain folders), so shards would need a gather step on resume that moves
every shard to every node anyway; a shared folder is what clusters already offer (Slurm sites mount
a shared file system, KubeRay mounts a ReadWriteMany volume), and it keeps metrics, plans and
checkpoints of one run in one place.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowrl.contract import ConfigError

#: The probe's folder inside the run folder's cache (removed after the check).
PROBE = "shared-probe"


def worker_side(folder: str, token: str, rank: int, node: str) -> str | None:
    """On a worker: read the driver's token in ``folder`` and write this rank's; returns why not, or None."""
    path = Path(folder)
    try:
        seen = (path / "driver").read_text()
    except OSError as exc:
        return f"cannot read {path / 'driver'} ({exc.strerror or exc})"
    if seen != token:
        return f"reads another file at {path / 'driver'} (another run's, or another file system's)"
    try:
        (path / f"rank-{rank}").write_text(f"{token} {node}")
    except OSError as exc:
        return f"cannot write {path / f'rank-{rank}'} ({exc.strerror or exc})"
    return None


def check(run: Path, ranks: Sequence[Any], call: Any) -> None:
    """Probe ``run`` from every rank. ``ranks``: each rank's node (a `flowrl.contract.ClusterNode`);
    ``call(method, args_per_rank)`` runs ``method`` on every rank and returns the results."""
    folder = (run / ".cache" / PROBE).resolve()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    token = secrets.token_hex(16)
    (folder / "driver").write_text(token)
    try:
        answers = call("probe_folder", [(str(folder), token, r, n.node_id) for r, n in enumerate(ranks)])
        for rank, (node, why) in enumerate(zip(ranks, answers)):
            if why is None:
                try:
                    back = (folder / f"rank-{rank}").read_text()
                except OSError:
                    back = ""
                if back != f"{token} {node.node_id}":
                    why = f"writes {folder / f'rank-{rank}'}, but the driver does not find it there"
            if why is not None:
                raise ConfigError(
                    f"the run folder '{run.resolve()}' is not shared with worker rank {rank} on {node.describe()}: it "
                    f"{why}. Checkpoints are written by rank 0 and read back by every rank, so the run folder must be "
                    "on a file system every node mounts at the same path (NFS, Lustre, a Kubernetes ReadWriteMany "
                    "volume): put --out there."
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
