"""The ready-to-edit launch files for several machines (docs/guides/multinode.md) hold together: the
KubeRay RayJob parses, runs `flowrl run --address auto` with its run folder on a ReadWriteMany volume
that every pod mounts there; the Slurm script is valid bash that starts Ray's head and workers with
srun and runs flowrl against that head."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_rayjob_runs_flowrl_on_its_cluster_with_the_run_folder_on_a_shared_volume() -> None:
    docs = list(yaml.safe_load_all((ROOT / "examples" / "kubernetes" / "rayjob.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"PersistentVolumeClaim", "RayJob"}
    claim, job = by_kind["PersistentVolumeClaim"], by_kind["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["flowrl", "run"] and argv[argv.index("--address") + 1] == "auto"
    out = argv[argv.index("--out") + 1]
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for pod in pods:  # every pod mounts the claim at a folder that holds the run folder
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        (container,) = pod["spec"]["containers"]
        mounts = [
            m["mountPath"]
            for m in container["volumeMounts"]
            if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        ]
        assert any(Path(out).is_relative_to(m) for m in mounts), (container["name"], mounts, out)
    gpus = [g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
            for g in cluster["workerGroupSpecs"]]  # fmt: skip
    assert all(int(n) >= 1 for n in gpus)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_sbatch_script_is_bash_that_starts_ray_with_srun_and_runs_flowrl_against_its_head() -> None:
    path = ROOT / "examples" / "slurm" / "flowrl.sbatch"
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    text = path.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0] == "#!/bin/bash" and any(line.startswith("#SBATCH --nodes=") for line in lines)
    assert "ray start --head" in text and "ray start --address=" in text and text.count("srun ") >= 3
    assert 'flowrl run "$GRAPH" --address "$RAY_ADDRESS"' in text
    assert '--resume "$RUNS/$NAME" --address "$RAY_ADDRESS"' in text
    assert "ray stop" not in text.replace("never `ray stop`", "")
