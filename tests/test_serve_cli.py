"""``qllama serve`` from the command line: it starts on an ephemeral port of 127.0.0.1, says
where, answers, and shuts down on SIGTERM; bad arguments end it with one line and status 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from qllama.cli import main  # noqa: E402
from qllama.cli.serve import named_files  # noqa: E402
from qllama.errors import QllamaError  # noqa: E402
from qllama.synthetic import TinyConfig, write_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_serve_starts_answers_and_stops(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny(path, TinyConfig(weight_type="Q8_0"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "qllama.cli",
        "serve",
        f"m={path}",
        "--port",
        "0",
        "--api-key",
        "k",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        url = None
        assert proc.stderr is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"the server ended: {proc.poll()}"
            if " on http://" in line:
                url = line.rsplit(" on ", 1)[1].strip()
        assert url is not None and url.startswith("http://127.0.0.1:")
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/health", timeout=30).status_code == 401
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["qllama"]["file"] == "tiny.gguf"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    # uvicorn shuts down gracefully, then re-raises the signal for the parent to see
    assert proc.returncode in (0, -signal.SIGTERM)
    assert proc.stderr is not None and "Traceback" not in proc.stderr.read()


def test_serve_refuses_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "nope.gguf"), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("qllama serve: error:") and "Traceback" not in err


def test_model_names() -> None:
    assert named_files(["a/x.gguf", "y=b/x.gguf"]) == {"x": "a/x.gguf", "y": "b/x.gguf"}
    with pytest.raises(QllamaError, match="two models are named 'x'"):
        named_files(["a/x.gguf", "b/x.gguf"])
