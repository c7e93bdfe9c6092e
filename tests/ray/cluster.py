"""A real local Ray cluster on loopback for tests: a head and more node processes, each `ray start`.

Every node gets its own temp dir under one short root (Ray's socket paths must stay short), so
teardown finds exactly the processes this cluster started: those holding a file under that root
(Ray's daemons, workers, replicas and their vLLM engines all keep their logs open there). They
are killed by pid; `ray stop --force` would also kill other users' Ray processes on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
NODE_LAUNCHER = Path(__file__).with_name("ray_node.py")
#: The driver (`ds4-vllm ray-serve`) keeps loopback addresses with this (ray_node.py says why).
DRIVER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: Logical CPUs per node: Ray's OpenAI ingress and the replicas reserve CPUs that the engines'
#: real threads do not use (measured: the ingress did not schedule with 2).
NODE_CPUS = 8


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("RAY_ADDRESS", None)
    # Ray's memory monitor kills workers when the machine (not Ray) is short of memory; on a
    # shared test machine other users' processes set that off and it killed Serve's controller.
    env["RAY_memory_monitor_refresh_ms"] = "0"
    return env


class RayCluster:
    def __init__(self, nodes: int = 2) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
        self.nodes = nodes
        self.address = ""
        self.procs: list[subprocess.Popen] = []

    def _start_node(self, name: str, args: list[str]) -> None:
        temp = self.root / name
        temp.mkdir()
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the node
        cmd = [sys.executable, str(NODE_LAUNCHER), "start", "--block", "--node-ip-address=127.0.0.1"]
        cmd += [f"--num-cpus={NODE_CPUS}", f"--temp-dir={temp}", "--disable-usage-stats", *args]
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=base_env(), start_new_session=True
            )
        )

    def start(self, timeout: float = 300.0) -> RayCluster:
        self._start_node("head", ["--head", "--port=0", "--include-dashboard=false"])
        marker = self.root / "head" / "ray_current_cluster"
        deadline = time.monotonic() + timeout
        while not marker.exists():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise RuntimeError(f"ray head did not start: {(self.root / 'head.log').read_text()[-3000:]}")
            time.sleep(0.5)
        self.address = marker.read_text().strip()
        for k in range(1, self.nodes):
            self._start_node(f"node{k}", [f"--address={self.address}"])
        self.wait_for_nodes(timeout)
        return self

    def wait_for_nodes(self, timeout: float) -> None:
        code = (
            f"import ray, json; ray.init(address={self.address!r}, logging_level='ERROR');"
            "print(json.dumps(sum(n['Alive'] for n in ray.nodes())))"
        )
        deadline = time.monotonic() + timeout
        while True:
            out = self.driver_python(code, timeout=timeout)
            if out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1]) >= self.nodes:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray nodes did not join: {out.stderr[-2000:]}")
            time.sleep(2)

    def driver_python(self, code: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
        env = base_env() | DRIVER_ENV
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
        )

    def deploy(
        self,
        app: str,
        store_url: str,
        *,
        replicas: int,
        extra: list[str],
        env: dict[str, str],
        port: int,
        timeout: float = 1500.0,
    ) -> str:
        """`ds4-vllm ray-serve` as a user runs it; returns its output."""
        cmd = [sys.executable, "-m", "ds4_vllm.cli.main", "ray-serve", "--address", self.address]
        cmd += ["--app-name", app, "--route-prefix", f"/{app}", "--port", str(port)]
        cmd += ["--replicas", str(replicas), "--kv-disk-dir", store_url, *extra]
        out = subprocess.run(
            cmd, capture_output=True, text=True, env=base_env() | DRIVER_ENV | env, timeout=timeout
        )
        if out.returncode != 0:
            raise RuntimeError(f"ray-serve {app} failed ({out.returncode}): {out.stderr[-4000:]}")
        return out.stdout

    def delete(self, app: str) -> None:
        code = f"import ray; from ray import serve; ray.init(address={self.address!r}); serve.delete({app!r})"
        self.driver_python(code)

    def serve_logs(self) -> list[Path]:
        return sorted(self.root.glob("*/session_latest/logs/serve/replica_*.log"))

    def pids(self) -> list[int]:
        """Processes holding a file under this cluster's root: exactly the ones it started."""
        mine = []
        root = str(self.root)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if any(os.readlink(fd).startswith(root) for fd in (proc / "fd").iterdir()):
                    mine.append(int(proc.name))
            except OSError:
                continue
        return mine

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
            pids = set(self.pids()) | {p.pid for p in self.procs if p.poll() is None}
            pids.discard(os.getpid())
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(wait if pids else 0)
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["RayCluster", "free_port"]
