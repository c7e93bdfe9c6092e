"""Start and stop a real `vllm serve` process on loopback for end-to-end tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> str:
    """The `vllm` console script of the environment running the tests."""
    candidate = Path(sys.executable).with_name("vllm")
    return str(candidate) if candidate.exists() else (shutil.which("vllm") or "vllm")


class ServerProcess:
    """`vllm serve ARGS` with its log in ``log_path``; waits for /health, stops with SIGINT (or another signal).

    `command` replaces `vllm serve ARGS --host --port` by a program that takes its port from the
    `PORT` environment variable (`scripts/serve.sh`).
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.command = command or [
            vllm_command(),
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PORT": str(self.port), **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240.0) -> ServerProcess:
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._log = log
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.25)  # refused until the server listens: each start waits half this, on average
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0, signal_number: int = signal.SIGINT) -> int | None:
        """Stop with `signal_number` (kill after `timeout` s); the exit status, None if never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal_number)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
