"""A real S3-compatible server for tests: moto's standalone server in its own process, over HTTP on localhost."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "eu-central-1"}


def upload_then_sigkill(call: str, source: Path, url: str) -> list[list[str]]:
    """Run `call` ("module:function", sync_up's signature) of `source` to `url` in a child process that reports each
    file it uploaded and waits for a line before the next; SIGKILL it after the second. The two reports."""
    module, function = call.split(":")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; from pathlib import Path; from {module} import {function}; "
            f"{function}(Path(sys.argv[1]), sys.argv[2], lambda p, a: (print(a, p, flush=True), sys.stdin.readline()))",
            str(source),
            url,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None  # both are pipes (PIPE above)
    done = [child.stdout.readline().split()]
    child.stdin.write("\n")
    child.stdin.flush()
    done.append(child.stdout.readline().split())
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    return done


class S3Server:
    """`python -m moto.server` on a free port; `endpoint` is its URL once started."""

    def __init__(self, log: Path):
        self.log = log
        self.endpoint = ""
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> S3Server:
        # The request log goes to a file: a pipe nobody drains would block the server once full.
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"Running on (http://127\.0\.0\.1:\d+)", self.log.read_text(errors="replace"))
            if found:
                self.endpoint = found.group(1)
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto server did not start; its log:\n{self.log.read_text(errors='replace')}")

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def requests(self) -> list[tuple[str, str, str]]:
        """(method, path without query, status) of every request served so far, from the server's log (a line is
        written before its response goes out)."""
        log = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))  # werkzeug colours its lines
        found = re.findall(r'"([A-Z]+) ([^ ?"]+)\S* HTTP/[\d.]+" (\d{3})', log)
        return [tuple(r) for r in found]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
