"""Test helpers: a real uvicorn server on 127.0.0.1 (a free port) run in a background thread, and `atlas serve` in a
subprocess (Serve)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from atlas.config import EngineConfig
from atlas.engine.async_engine import AsyncEngine
from atlas.engine.core import EngineCore
from atlas.server.app import build_app
from atlas.server.cli import bind_socket, make_uvicorn_server, url_of
from atlas.server.settings import ServerSettings


class ServerThread:
    """Serve an EngineCore over HTTP until stop(). `url` is e.g. http://127.0.0.1:PORT. `settings` are
    the server's own (ServerSettings fields)."""

    def __init__(self, core: EngineCore, api_key: str | None = None, served_model_names: list[str] | None = None,
                 **settings):
        self.core = core
        self.engine = AsyncEngine(core, start=False)
        self.app = build_app(self.engine, served_model_names, api_key, settings=ServerSettings(**settings))
        self.state = self.app.state.server
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.server = make_uvicorn_server(self.app, log_level="warning", access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def start_server(model: str, api_key: str | None = None, settings: dict | None = None,
                 served_model_names: list[str] | None = None, **engine_kwargs) -> ServerThread:
    core = EngineCore(EngineConfig.from_kwargs(model=model, **engine_kwargs))
    return ServerThread(core, api_key=api_key, served_model_names=served_model_names, **(settings or {})).start()


def assert_error(resp, status: int, param: str | None = None, code: str | None = None) -> dict:
    """resp is an OpenAI error: that status, the body {"error": {message, type, param, code}}, no traceback."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


_SLOW_ATLAS = """
import sys, time
from atlas.runtime import model_runner
real = model_runner.ModelRunner.launch
def slow(self, *args, **kwargs):
    time.sleep({seconds})
    return real(self, *args, **kwargs)
model_runner.ModelRunner.launch = slow
from atlas.cli import main
sys.exit(main(sys.argv[1:]))
"""


def slow_atlas_command(step_seconds: float) -> list[str]:
    """The `atlas` command (arguments to append), with every engine step made `step_seconds` slower: time
    to interrupt a reply or a shutdown while requests are running."""
    return [sys.executable, "-c", _SLOW_ATLAS.format(seconds=step_seconds)]


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


if __name__ == "__main__":
    # `python tests/serving.py DIR` writes the tests' tiny random Qwen3 checkpoint (2 layers, hidden 64, a
    # 384-token BPE tokenizer with a ChatML template) under DIR and prints its path: a model for trying the
    # server or `atlas bench serve` by hand.
    import sys
    from pathlib import Path

    import conftest

    root = Path(sys.argv[1])
    root.mkdir(parents=True, exist_ok=True)

    class _Dirs:
        def mktemp(self, name: str) -> Path:
            (root / name).mkdir(exist_ok=True)
            return root / name

    print(conftest.build_checkpoint(root, "Qwen3ForCausalLM", conftest.tokenizer_dir.__wrapped__(_Dirs())))


ENGINE_FLAGS = ["--kv-cache-memory", "4MiB", "--max-model-len", "256", "--no-access-log"]


class Serve:
    """`atlas serve` in a subprocess: its URL, the engine's pid and the front ends' pids, read from its log."""

    def __init__(self, model: str, *flags: str, step_seconds: float = 0.0):
        cmd = [*slow_atlas_command(step_seconds)] if step_seconds else [sys.executable, "-m", "atlas.cli"]
        cmd += ["serve", "--model", model, "--port", "0", *ENGINE_FLAGS, *flags]
        env = {**os.environ, "ATLAS_API_KEY": ""}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.url = None
        self.engine_pid = None
        self.engine_pids: list[int] = []  # (several with --data-parallel-size)
        self.front_end_pids: list[int] = []
        from atlas.server.cli import default_api_server_count

        self.count = (int(flags[flags.index("--api-server-count") + 1]) if "--api-server-count" in flags
                      else default_api_server_count())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert wait_until(lambda: self.url is not None and len(self.front_end_pids) >= self.count, timeout=90), \
            self.log

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"engines? (?:replicas )?in process(?:es)? ([\d, ]+), .* listening on "
                          r"(http://127\.0\.0\.1:\d+)", line)
            if m:
                self.engine_pids = [int(pid) for pid in m.group(1).split(", ")]
                self.engine_pid, self.url = self.engine_pids[0], m.group(2)
            m = re.search(r"Started server process \[(\d+)\]", line)
            if m:
                self.front_end_pids.append(int(m.group(1)))

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def metric(self, name: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)

    def wait(self, timeout: float) -> int:
        self.proc.wait(timeout)
        self._reader.join(10)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
