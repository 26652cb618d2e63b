"""A throw-away Slurm cluster for tests: munged, slurmctld and one slurmd per node, all in a temporary
folder with their own ports, socket and state (Debian 12's ``slurm-wlm``, 22.05; the cluster's software,
never a dependency of the project). No cgroups: ``proctrack/linuxproc``, ``task/none``.

Nodes are ``(name, address, command prefix)``: one node ``("localhost", "127.0.0.1", [])`` on this
machine, or one node per :class:`netns.Host` (its prefix runs a daemon in its namespace; the controller
runs on the first). :func:`slurm_cluster` yields the environment that points Slurm's commands at it, and
stops every daemon it started on exit (running jobs are cancelled first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from netns import Unavailable

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel", "srun")

CONF = """\
ClusterName=meshtraintest
SlurmctldHost={ctl_name}({ctl_addr})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/run/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(folder: Path) -> str:
    return " | ".join(f"{log.name}: {' / '.join(log.read_text(errors='replace').splitlines()[-3:])}"
                      for log in sorted(folder.glob("*.log")))


@contextlib.contextmanager
def slurm_cluster(nodes: list[tuple[str, str, list[str]]], base_env: dict[str, str]):
    """Start the cluster; yield ``base_env`` plus ``SLURM_CONF``. Raises :class:`netns.Unavailable` when
    Slurm is not installed or does not come up (the daemons' last log lines say why)."""
    missing = [name for name in COMMANDS if shutil.which(name) is None]
    if missing:
        raise Unavailable(f"Slurm is not installed here (no {', '.join(missing)}): apt-get install slurm-wlm")
    if os.geteuid() != 0:
        raise Unavailable(f"slurmd must run as root to start jobs; this runs as uid {os.geteuid()}")
    folder = Path(tempfile.mkdtemp(prefix="meshtrain-slurm-"))
    folder.chmod(0o711)  # munged refuses a socket in a folder others cannot traverse
    daemons: list[subprocess.Popen] = []
    try:
        for sub, mode in (("run", 0o755), ("munge", 0o700), ("state", 0o700)):
            (folder / sub).mkdir(mode=mode)
        (folder / "munge/munge.key").write_bytes(os.urandom(1024))
        (folder / "munge/munge.key").chmod(0o400)
        node_lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs=2 State=UNKNOWN\n" for name, addr, _ in nodes)
        (folder / "slurm.conf").write_text(CONF.format(ctl_name=nodes[0][0], ctl_addr=nodes[0][1], dir=folder,
                                                       ctl_port=_free_port(), d_port=_free_port(), nodes=node_lines))
        env = {**base_env, "SLURM_CONF": str(folder / "slurm.conf")}
        quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        daemons.append(subprocess.Popen(
            ["munged", "-F", f"--socket={folder}/run/munge.socket", f"--key-file={folder}/munge/munge.key",
             f"--pid-file={folder}/munge/munged.pid", f"--log-file={folder}/munged.log",
             f"--seed-file={folder}/munge/munged.seed"], **quiet))
        _wait(lambda: (folder / "run/munge.socket").exists(), 20, folder, "munged")
        daemons.append(subprocess.Popen([*nodes[0][2], "slurmctld", "-D"], **quiet))
        for name, _, prefix in nodes:
            daemons.append(subprocess.Popen([*prefix, "slurmd", "-D", "-N", name], **quiet))
        sinfo = [*nodes[0][2], "sinfo", "-h", "-o", "%n %T"]
        _wait(lambda: _states(sinfo, env) == {name: "idle" for name, _, _ in nodes}, 60, folder, "the nodes")
        yield env
    finally:
        if daemons:  # cancel what still runs, and let the nodes clean up its steps before they stop
            subprocess.run([*nodes[0][2], "scancel", "--user", "root"], env=env, capture_output=True)
            with contextlib.suppress(Unavailable):
                _wait(lambda: not _states([*nodes[0][2], "squeue", "-h", "-o", "%i %T"], env), 30, folder, "cancel")
        for daemon in reversed(daemons):  # slurmd, slurmctld, then munged
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _states(sinfo: list[str], env: dict[str, str]) -> dict[str, str]:
    rows = subprocess.run(sinfo, env=env, capture_output=True, text=True).stdout.split("\n")
    return dict(row.split()[:2] for row in rows if len(row.split()) >= 2)


def _wait(ready, seconds: float, folder: Path, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise Unavailable(f"{what} did not come up within {seconds:.0f} s: {_log_tail(folder)}")
        time.sleep(0.5)
