"""Rank processes forked from one Python that has imported torch, Lightning and the package once.

A fresh ``python script.py`` spends about 5 s of CPU importing torch, Lightning, torchmetrics and transformers before
it runs a line of the script; a scenario of four ranks and its one-process reference pay that five times, on two
cores. The server (``python -m benchmarks.common.fork_server SOCKET``) imports them, then forks one child per request:
the child takes the request's environment, working directory, ``sys.argv`` and output files, reseeds Python's and
NumPy's generators from the OS (as a new interpreter would) and runs the script as ``__main__``. Each child is a
process of its own, with its own process group over gloo: only the import is shared.

What a forked rank cannot reproduce, the launches that test it do not use: Lightning's own launcher (each rank is
started here with the variables that launcher gives its children: ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), variables read while importing torch (the server's own environment), and a
process's first import of the package. Set ``LIGHTNING_DIST_FORK_LAUNCH=0`` to start every rank as a new Python.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common.launch import child_env

ROOT = Path(__file__).resolve().parents[2]
#: What the server imports before it forks: what nearly every scenario script imports first.
PRELOAD = ("torch", "lightning", "transformers", "lightning_dist.strategies", "common", "models")
#: Where the preloaded ``common`` and ``models`` come from: a script elsewhere imports its own.
SCENARIO_DIR = ROOT / "tests" / "scenarios"


class _Lines:
    """The lines that arrive on a connection, read without a buffer that could hold back the next one."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self._buffer = b""

    def next(self, timeout: float | None) -> str | None:
        """The next line; ``""`` once the other end closed; ``None`` if none arrived within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.connection], [], [], left)[0]:
                return None
            chunk = self.connection.recv(4096)
            if not chunk:
                return ""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


class ForkedProcess:
    """A child of the server, seen from the client: ``poll``, ``wait``, ``kill`` and ``returncode`` as on
    ``subprocess.Popen``."""

    def __init__(self, lines: _Lines, pid: int) -> None:
        self._lines = lines
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _read_status(self, timeout: float | None) -> None:
        line = self._lines.next(timeout)
        if line is None:
            return
        self._lines.connection.close()
        # a server that died took its children with it: report the child as killed
        self.returncode = int(json.loads(line)["status"]) if line else -signal.SIGKILL


class ForkServer:
    """The client: starts the server on first use (one per client process) and asks it for children."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._address = ""

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, output: Path) -> ForkedProcess:
        """Fork a child that runs ``argv`` (a script and its arguments, after the interpreter) with ``env`` in
        ``cwd``, its stdout and stderr appended to ``output``."""
        self._ensure_started()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self._address)
        request = {"argv": argv, "env": env, "cwd": str(cwd), "output": str(output)}
        connection.sendall((json.dumps(request) + "\n").encode())
        lines = _Lines(connection)
        reply = lines.next(timeout=60)
        if not reply:
            raise RuntimeError(f"the fork server ({self._address}) did not start the process: is it still running?")
        return ForkedProcess(lines, int(json.loads(reply)["pid"]))

    def _ensure_started(self) -> None:
        if self._server is not None and self._server.poll() is None:
            return
        self._address = os.path.join(tempfile.mkdtemp(prefix="lightning_dist_fork_"), "server.sock")
        env = child_env()  # what a new Python started by the launcher would import with
        self._server = subprocess.Popen([sys.executable, "-m", "benchmarks.common.fork_server", self._address],
                                        cwd=str(ROOT), env=env, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 300
        while not os.path.exists(self._address):
            if self._server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (status {self._server.poll()})")
            time.sleep(0.05)
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.terminate()
            self._server.wait()
        if self._address:
            shutil.rmtree(os.path.dirname(self._address), ignore_errors=True)


_CLIENT = ForkServer()


def start(argv: list[str], env: dict[str, str], cwd: Path, output: Path) -> ForkedProcess:
    """:meth:`ForkServer.start` on this process's server."""
    return _CLIENT.start(argv, env, cwd, output)


# ------------------------------------------------------------------------------------------------------- the server
def _serve(address: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(64)
    os.replace(address + ".tmp", address)  # the client waits for the name: it appears once the server listens
    parent = os.getppid()
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # the client's process ended without stopping us: end too
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            request = json.loads(connection.makefile().readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                _run_child(request)
            children[pid] = connection
            connection.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid)
            try:
                connection.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:
                pass  # the client went away
            connection.close()
    for pid in children:
        os.kill(pid, signal.SIGKILL)


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested process, run its script, exit with its status."""
    status = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = str(Path(script).resolve().parent)  # as `python script.py` puts it
        if sys.path[0] != str(SCENARIO_DIR):
            for name in ("common", "models"):
                sys.modules.pop(name, None)
        _fresh_random_state()
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:  # OpenMP read the server's environment when torch was imported
            sys.modules["torch"].set_num_threads(int(threads))
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            if not isinstance(done.code, int) and done.code is not None:
                print(done.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 (reported as Python reports an uncaught exception)
            traceback.print_exc()
        threading._shutdown()  # type: ignore[attr-defined]  (what the interpreter does at exit, in its order)
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _fresh_random_state() -> None:
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


if __name__ == "__main__":
    sys.path[:0] = [str(SCENARIO_DIR), str(ROOT)]
    for module in PRELOAD:
        __import__(module)
    gc.collect()
    gc.freeze()  # the children's full collections leave the imported objects alone (nor copy their pages)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _serve(sys.argv[1])
