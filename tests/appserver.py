"""Start `python app.py` in a subprocess on a free 127.0.0.1 port (browser and load tests share this).

The server runs exactly as `make run` starts it (same entry point, background model warm-up) with one OpenMP
thread, offline, and without analytics. `rss_mb()` reads the server's resident memory from /proc.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = int(os.environ.get("DECODING_LAB_APP_START_S", "180"))  # more on a starved CPU


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class AppServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mb(self) -> float:
        """VmRSS of the server process in MiB (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("VmRSS not found")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _wait_until_up(server: AppServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"app.py exited with {server.process.returncode}:\n{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(server.url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"app.py did not answer within {timeout_s} s:\n{server.log()[-4000:]}")


@contextmanager
def running_app(log_dir: Path, extra_env: dict[str, str] | None = None):
    """Yield an AppServer for `python app.py`; the process is terminated (then killed) on exit."""
    port = free_port()
    env = {
        **os.environ,
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"app-{port}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = AppServer(f"http://127.0.0.1:{port}/", process, log_path)
    try:
        _wait_until_up(server, START_TIMEOUT_S)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
