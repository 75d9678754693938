"""Start a server as a child process on a free loopback port, wait until it answers, stop it cleanly.

    with ServerProcess.minillm(["--max-num-seqs", "32"]) as srv:     # python -m minillm serve ...
        print(srv.url)                                               # http://127.0.0.1:PORT
    with ServerProcess(["transformers", "serve", folder, "--port", "{port}"], ready="/v1/models") as peer:
        ...

`{port}` in the command is replaced by the port chosen. The notebook and the benchmarks start
minillm and its peers this way; Ctrl-C (SIGINT) stops each one (its graceful shutdown), and a
process that does not stop within `stop_timeout_s` is killed. Windows has no SIGINT to send to
another process: there the server starts in a process group of its own and gets Ctrl-Break
(CTRL_BREAK_EVENT), which uvicorn takes as the same graceful shutdown.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupt_signal() -> int:
    """What stops a server gracefully: SIGINT, or on Windows Ctrl-Break (to a process started in its own
    process group; `send_signal(SIGINT)` raises ValueError there)."""
    return signal.CTRL_BREAK_EVENT if sys.platform == "win32" else signal.SIGINT


class ServerProcess:
    def __init__(self, command: list[str], ready: str = "/health", port: int | None = None,
                 start_timeout_s: float = 300.0, stop_timeout_s: float = 30.0, env: dict | None = None,
                 cwd: str | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [c.replace("{port}", str(self.port)) for c in command]
        self.ready, self.start_timeout_s, self.stop_timeout_s = ready, start_timeout_s, stop_timeout_s
        self.env, self.cwd = {**os.environ, **(env or {})}, cwd
        self.log = tempfile.NamedTemporaryFile("w+", prefix="server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @classmethod
    def minillm(cls, args: list[str] = (), **kwargs) -> "ServerProcess":
        return cls([sys.executable, "-m", "minillm", "serve", "--port", "{port}", *args], **kwargs)

    def start(self) -> "ServerProcess":
        import httpx

        group = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if sys.platform == "win32" else {}
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                     **group)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{' '.join(self.command)} did not answer in {self.start_timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(interrupt_signal())
        try:
            return self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def tail(self, n: int = 20) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
