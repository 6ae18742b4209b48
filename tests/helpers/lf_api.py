"""Helpers to run ``llamafactory-cli api`` as a subprocess and talk to it (tests only)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from helpers.lf_runs import CLI, REPO, failure_text

API_PACKAGES = ("fastapi", "uvicorn", "sse_starlette")  # LLaMA-Factory's api extra
MISSING_API = [p for p in API_PACKAGES if importlib.util.find_spec(p) is None]


def free_port() -> int:
    """A local TCP port that was free a moment ago (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    """GET ``url`` (or POST ``body`` as JSON) and return the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def stream_text(url: str, body: dict, timeout: float = 60) -> str:
    """POST a ``stream: true`` chat completion and join the streamed ``delta.content`` pieces
    (server-sent events ``data: {...}`` up to ``data: [DONE]``) within ``timeout`` seconds in all:
    the server pings an open stream every 15 s, so a stalled generation never times the socket out."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    pieces = []
    deadline = time.monotonic() + timeout
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            assert time.monotonic() < deadline, f"stream not done after {timeout} s; got {pieces}"
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                break
            pieces.append(json.loads(payload)["choices"][0]["delta"].get("content") or "")
    return "".join(pieces)


def start_api(recipe: Path, log_path: Path, ready_s: float = 180) -> tuple[subprocess.Popen, str]:
    """Start ``llamafactory-cli api recipe`` on a free local port, wait until it lists its model;
    returns the process (its output in ``log_path``) and the ``.../v1`` base URL."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 (closed by stop_api())
    proc = subprocess.Popen(
        [str(CLI), "api", str(recipe)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "API_HOST": "127.0.0.1", "API_PORT": str(port)},
    )
    proc.log_file = log
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            log.close()
            raise AssertionError(failure_text(log_path.read_text()))
        try:
            assert http_json(f"{base}/models", timeout=5)["data"], "no model listed"
            return proc, base
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                stop_api(proc)
                tail = log_path.read_text()[-3000:]
                raise AssertionError(f"api not ready after {ready_s} s\n{tail}") from None
            time.sleep(0.5)


def stop_api(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    """SIGINT (how a user stops the server), then the exit status; killed if it does not stop
    within ``timeout`` (None then)."""
    rc = None
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.log_file.close()
    return rc
