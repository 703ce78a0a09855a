"""Progress of the long commands (issue 57, item 5): a bar on a terminal (rich, as Lightning's ``RichProgressBar``),
a plain line per update into a pipe, nothing with ``--quiet``; ``export`` and ``consolidate`` run as users run them,
``dryrun``'s in tests/test_dryrun.py (its pipe), the rules below on :class:`~lightning_dist.progress.Progress`."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

from lightning_dist.progress import Progress

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^export: \d+\.\d MiB of \d+\.\d MiB \(\d+%\), \d+ s(, about \d+ s left)?$")


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightning_dist.cli", *args]


def test_into_a_pipe_each_update_is_a_plain_line_ending_at_all_written(llama_checkpoint, tmp_path):
    done = subprocess.run(_command("export", str(llama_checkpoint), str(tmp_path / "out"), "--format", "hf"), cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("export:")]
    assert lines and all(LINE.match(line) for line in lines), lines
    assert "(100%)" in lines[-1] and "\r" not in done.stderr and "\x1b[" not in done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'out'} (hf:")  # the result stays on stdout


def test_on_a_terminal_it_is_a_bar(llama_checkpoint, tmp_path):
    leader, follower = pty.openpty()
    process = subprocess.Popen(_command("consolidate", str(llama_checkpoint), str(tmp_path / "one.ckpt")), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=follower, env={**os.environ, "COLUMNS": "100"})  # fmt: skip
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown += chunk
    assert process.wait(timeout=300) == 0
    text = shown.decode(errors="replace")
    assert "consolidate" in text and "━" in text and "\x1b[" in text, text[-2000:]  # rich's bar, redrawn in place
    assert not re.search(r"^consolidate: .* MiB of", text, re.MULTILINE)  # not the plain lines of a pipe


def test_quiet_prints_nothing_but_errors(llama_checkpoint, tmp_path):
    for args in (["export", str(llama_checkpoint), str(tmp_path / "out"), "--format", "hf"],
                 ["consolidate", str(llama_checkpoint), str(tmp_path / "one.ckpt")]):  # fmt: skip
        done = subprocess.run(_command(*args, "--quiet"), cwd=REPO, capture_output=True, text=True, timeout=300,
                              check=False)  # fmt: skip
        assert done.returncode == 0 and Path(args[2]).exists(), done.stderr[-2000:]
        assert done.stdout == "" and f"{args[0]}:" not in done.stderr and "wrote" not in done.stderr
    refused = subprocess.run(_command("consolidate", str(llama_checkpoint), str(llama_checkpoint), "--quiet"), cwd=REPO,
                             capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert refused.returncode == 2 and "Refusing to write" in refused.stderr and refused.stdout == ""


def test_plain_lines_come_at_most_once_a_second_and_the_last_always(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("lightning_dist.progress.time.monotonic", lambda: now[0])
    stream = io.StringIO()
    progress = Progress(4 * 2**20, "export", stream=stream)  # starts at 0 s
    for at in (0.1, 0.5, 1.2, 1.3):  # a first line, one too soon, one a second after it, the last
        now[0] = at
        progress.update(2**20)
    assert stream.getvalue().splitlines() == [
        "export: 1.0 MiB of 4.0 MiB (25%), 0 s, about 0 s left",
        "export: 3.0 MiB of 4.0 MiB (75%), 1 s, about 0 s left",
        "export: 4.0 MiB of 4.0 MiB (100%), 1 s",
    ]
    quiet = io.StringIO()
    with Progress(10, "dryrun", unit="ranks", quiet=True, stream=quiet) as silent:
        silent.update(10)
    assert quiet.getvalue() == "" and silent.done == 10
