"""``jupyter lab notebooks/`` (the README's command) starts on loopback and serves every notebook through its REST
API; a kernel starts and stops. No network beyond 127.0.0.1; the server is always terminated."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STARTUP_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A running server: ``call("GET", "/api/status")`` → decoded JSON (token in the header)."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def call(self, method: str, path: str, body: dict | None = None) -> object:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    jupyter = Path(sys.executable).with_name("jupyter")
    if not jupyter.exists() and shutil.which("jupyter") is None:
        pytest.skip("needs JupyterLab (pip install 'kvlab[notebooks]')")
    home = tmp_path_factory.mktemp("jupyter")
    port, token = free_port(), secrets.token_hex(16)
    # config, data and runtime files of this server stay in a temporary folder, not the user's ~/.jupyter
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "MPLBACKEND": "Agg"}
    argv = [str(jupyter) if jupyter.exists() else "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
            f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={NOTEBOOKS}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly", "--allow-root"]
    log = (home / "server.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                server.call("GET", "/api/status")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"jupyter lab did not answer within {STARTUP_S:.0f} s (exit {proc.poll()}):\n"
                                + (home / "server.log").read_text()[-3000:])
                time.sleep(0.25)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def test_lab_serves_every_notebook(lab):
    listing = lab.call("GET", "/api/contents/")
    names = {item["name"] for item in listing["content"] if item["type"] == "notebook"}
    assert names == {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    for name in sorted(names):
        model = lab.call("GET", f"/api/contents/{urllib.request.quote(name)}?content=1")
        assert model["type"] == "notebook" and model["format"] == "json", name
        assert len(model["content"]["cells"]) > 0, name
        assert model["content"]["metadata"]["kernelspec"]["name"] == "python3", name


def test_lab_starts_and_stops_a_kernel(lab):
    specs = lab.call("GET", "/api/kernelspecs")
    assert "python3" in specs["kernelspecs"]
    kernel = lab.call("POST", "/api/kernels", {"name": "python3"})
    try:
        assert kernel["name"] == "python3"
        assert any(k["id"] == kernel["id"] for k in lab.call("GET", "/api/kernels"))
    finally:
        lab.call("DELETE", f"/api/kernels/{kernel['id']}")
    assert all(k["id"] != kernel["id"] for k in lab.call("GET", "/api/kernels"))
