"""Test helper: a real uvicorn server on 127.0.0.1 (a free port), run in a background thread."""

from __future__ import annotations

import sys
import threading
import time

from atlas.config import EngineConfig
from atlas.engine.async_engine import AsyncEngine
from atlas.engine.core import EngineCore
from atlas.server.app import ServerSettings, build_app
from atlas.server.cli import bind_socket, make_uvicorn_server, url_of


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
