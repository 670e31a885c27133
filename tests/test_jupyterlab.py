"""The self-study path: JupyterLab from the course environment opens and executes the lab.

Starts ``jupyter lab`` headless on 127.0.0.1 with a token, fetches ``notebooks/08_lab.ipynb`` through the
server's contents API, starts a ``python3`` kernel through the sessions API, executes every code cell over
the kernel's websocket (the parameters cell set to a quick run) and checks the results files.
"""

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from tornado.websocket import websocket_connect

from course_lib import strategies

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base, token, path, method="GET", body=None):
    req = urllib.request.Request(
        f"{base}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read()
        return json.loads(text) if text else None


@pytest.fixture
def server(tmp_path):
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        COURSE_BUILD_DIR=str(tmp_path / "build"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={ROOT}",
            "--ServerApp.port_retries=0",
        ]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                api(base, token, "/api/status")
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start:\n{proc.stdout.read().decode()[-3000:]}"
                    ) from None
                time.sleep(0.5)
        yield base, token, tmp_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_unauthenticated_requests_are_refused(server):
    base, _, _ = server
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{base}/api/contents/notebooks", timeout=10)
    assert e.value.code == 403


async def execute_all(ws_url, cells, timeout_s=300):
    ws = await websocket_connect(ws_url)
    session = uuid.uuid4().hex
    for i, source in enumerate(cells):
        msg_id = uuid.uuid4().hex
        ws.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": "test",
                        "session": session,
                        "msg_type": "execute_request",
                        "version": "5.3",
                        "date": "",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "buffers": [],
                    "content": {
                        "code": source,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                }
            )
        )
        deadline = time.time() + timeout_s
        while True:
            raw = await asyncio.wait_for(ws.read_message(), timeout=max(1, deadline - time.time()))
            assert raw is not None, "kernel websocket closed"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "error":
                raise AssertionError(
                    f"cell {i} raised {msg['content']['ename']}: {msg['content']['evalue']}"
                )
            if msg["msg_type"] == "execute_reply":
                assert msg["content"]["status"] == "ok", msg["content"]
                break
    ws.close()


def test_lab_runs_in_jupyterlab(server):
    base, token, tmp = server
    nb = api(base, token, "/api/contents/notebooks/08_lab.ipynb")["content"]
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0]["metadata"]["tags"]
    results_dir = tmp / "lab-from-jupyterlab"
    params = (
        f'n_devices = 1\nplatform = "cpu"\nprofile = "tiny"\nsteps = 0\nglobal_batch = 0\nscaling = False\n'
        f"article_variant = False\nresults_dir = {str(results_dir)!r}\n"
        f'overwrite = False\nreference = "auto"\nseed = 0\n'
    )
    sources = [params] + ["".join(c["source"]) for c in code[1:]]
    sess = api(
        base,
        token,
        "/api/sessions",
        "POST",
        {
            "path": "notebooks/08_lab.ipynb",
            "type": "notebook",
            "name": "08_lab.ipynb",
            "kernel": {"name": "python3"},
        },
    )
    kernel_id = sess["kernel"]["id"]
    try:
        ws_url = f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels?token={token}"
        asyncio.run(execute_all(ws_url, sources))
    finally:
        api(base, token, f"/api/sessions/{sess['id']}", "DELETE")
    for name in ("lab_results.csv", "loss_curves.csv", "loss_curves.png", "comparison.png"):
        assert (results_dir / name).exists(), name
    rows = (results_dir / "lab_results.csv").read_text().splitlines()
    # every strategy of the registry on one device but the article's split (article_variant = False)
    expected = set(strategies.CNN_KEYS) - {"shard_map_article"}
    assert rows[0].startswith("strategy,") and {r.split(",")[0] for r in rows[1:]} == expected, rows
