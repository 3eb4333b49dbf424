"""A real Slurm cluster of three nodes on this machine, for the multi-node tests.

Debian's slurmctld/slurmd (22.05): `AuthType=auth/none`, `CredType=cred/none` (no munge), one
controller and three `slurmd -N nX` daemons on 127.0.0.1, each with its own port, spool, pid and
log file, all under one directory. Started and stopped by pid; `SLURM_CONF` points the clients at it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

NODES = ("n1", "n2", "n3")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    for exe in ("slurmctld", "slurmd", "srun", "sinfo", "scontrol", "squeue", "scancel", "salloc", "sbatch"):
        if not shutil.which(exe) and not os.path.exists(f"/usr/sbin/{exe}"):
            return f"{exe} not installed (apt-get install slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root (SlurmUser=root, SlurmdUser=root)"
    return None


def config(root: Path, ctld_port: int, node_ports: list[int], cpus: int) -> str:
    nodes = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={cpus} "
                      f"RealMemory=1000 State=UNKNOWN" for n, p in zip(NODES, node_ports))
    return f"""ClusterName=orchtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
AuthInfo=cred_expire=10
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
StateSaveLocation={root}/ctld
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmdTimeout=30
SlurmctldTimeout=30
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
KillOnBadExit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{nodes}
PartitionName=debug Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    pids: list[int] = field(default_factory=list)

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def idle_nodes(self) -> set[str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return {n for n, st in (line.split() for line in out.splitlines() if line.strip()) if st == "idle"}

    def stop(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for pid in self.pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.05)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        left = self.leftovers()   # a job step's slurmstepd outlives its slurmd (seen after a full run)
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this cluster still running: those whose environment names its slurm.conf (the job steps'
        slurmstepd and what they run). Never another cluster's or the machine's."""
        # the raw environment block: slurmstepd clears its start for its process title, so a parser that stops
        # at the first empty entry (psutil's) sees nothing
        mark, found = f"\0SLURM_CONF={self.env['SLURM_CONF']}\0".encode(), []
        for pid in psutil.pids():
            try:
                if pid != os.getpid() and mark in b"\0" + Path(f"/proc/{pid}/environ").read_bytes() + b"\0":
                    found.append(psutil.Process(pid))
            except (OSError, psutil.Error):
                pass
        return found


def _pid(path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.02)
    raise RuntimeError(f"{path} never appeared")


def start(root: Path, cpus: int = 2, timeout: float = 30) -> Cluster:
    """Controller and three node daemons, daemonized with pid files; returns once all nodes are idle."""
    root.mkdir(parents=True, exist_ok=True)
    ctld_port, *node_ports = _free_ports(4)
    for d in ("ctld", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    conf = root / "slurm.conf"
    conf.write_text(config(root, ctld_port, node_ports, cpus))
    # jobs submitted here run supervisors: their node history stays in the cluster's directory, never the machine's
    # (the cluster outlives the test that started it, so the per-test directory of conftest would not do)
    env = {**os.environ, "SLURM_CONF": str(conf), "ORCHESTRATOR_NODE_STATE_DIR": str(root / "node-state")}
    for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[k]  # never attach to an allocation of some outer cluster
    cluster = Cluster(root, env)
    try:
        subprocess.run([_sbin("slurmctld"), "-i"], env=env, check=True, timeout=30,
                       capture_output=True)
        cluster.pids.append(_pid(root / "slurmctld.pid", timeout))
        for n in NODES:
            subprocess.run([_sbin("slurmd"), "-N", n], env=env, check=True, timeout=30, capture_output=True)
            cluster.pids.append(_pid(root / f"slurmd-{n}.pid", timeout))
        deadline = time.monotonic() + timeout
        while cluster.idle_nodes() != set(NODES):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes not idle after {timeout}s: {cluster.run('sinfo', '-N', check=False).stdout}"
                                   f"\n{(root / 'slurmctld.log').read_text()[-3000:]}")
            time.sleep(0.1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    try:
        c = start(tmp_path_factory.mktemp("slurm"))
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"Slurm test cluster did not start: {e}")
    yield c
    c.stop()
    assert not c.leftovers(), "the test cluster left processes running"


def _sbin(exe: str) -> str:
    return shutil.which(exe) or f"/usr/sbin/{exe}"
