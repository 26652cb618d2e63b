"""``scripts/slurm/meshtrain.sbatch`` without Slurm: ``srun``, ``scontrol`` and ``meshtrain`` replaced by
stubs that print what they were given, so the command line each node's launcher gets is checked in
``make test`` (``test_clusters.py`` submits the script to a real Slurm in ``make test-slow``)."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT

SBATCH = ROOT / "scripts" / "slurm" / "meshtrain.sbatch"
STUBS = {
    "srun": """#!/bin/bash
echo "srun $*"
while [[ $1 == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_STEP_NUM_NODES=$SLURM_NNODES "$@"; done
""",
    "scontrol": '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n',
    "meshtrain": '#!/bin/bash\necho "launcher: $*"\n',
}


def run_script(tmp_path, slurm: dict[str, str], *args: str) -> list[str]:
    for name, text in STUBS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MESHTRAIN"))}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", MESHTRAIN=str(tmp_path / "meshtrain"), SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="gpu-a[17-18]", **slurm)
    proc = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("launcher: ")]


def test_two_gpu_nodes_meet_at_the_first_host(tmp_path):
    got = run_script(tmp_path, {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"},
                     "configs/x.toml", "--out", "runs/x", "--train.steps", "5")
    common = "train configs/x.toml --out runs/x --train.steps 5 --nproc 8 --nnodes 2 --rdzv-endpoint gpu-a17:29742"
    assert got == [f"launcher: {common} --node-rank 0", f"launcher: {common} --node-rank 1"]


def test_the_options_own_nproc_is_kept(tmp_path):
    """A --nproc among the options is the user's: the script adds none (argparse would let a later one win)."""
    gpus = {"SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "8", "MESHTRAIN_NPROC": "6"}
    assert run_script(tmp_path, gpus, "c.toml", "--nproc", "2") == ["launcher: train c.toml --nproc 2"]
    assert run_script(tmp_path, gpus, "c.toml", "--nproc=3") == ["launcher: train c.toml --nproc=3"]
    assert run_script(tmp_path, gpus, "c.toml") == ["launcher: train c.toml --nproc 6"]


def test_ranks_from_tasks_per_node_or_the_config_and_one_node_stays_local(tmp_path):
    got = run_script(tmp_path, {"SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "4"}, "c.toml")
    assert got == ["launcher: train c.toml --nproc 4"]
    got = run_script(tmp_path, {"SLURM_NNODES": "2", "MESHTRAIN_RDZV_PORT": "31000"}, "c.toml")
    assert got == [f"launcher: train c.toml --nnodes 2 --rdzv-endpoint gpu-a17:31000 --node-rank {r}" for r in (0, 1)]
