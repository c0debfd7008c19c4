"""The `atlas` command as a user runs it: generate and chat, in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from serving import slow_atlas_command

from atlas import LLM, SamplingParams


def _atlas(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atlas.cli", "--log-level", "warning", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_prints_the_greedy_completion(qwen3_dir):
    prompt = "def wrap(text):\n"
    expected = LLM(str(qwen3_dir), kv_cache_memory="8MiB").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    proc = _atlas("generate", "--model", str(qwen3_dir), "--prompt", prompt, "--max-tokens", "12", "--ignore-eos",
                  "--kv-cache-memory", "8MiB")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def test_chat_answers_through_the_template(qwen3_dir):
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB")
    expected = llm.chat([{"role": "user", "content": "hello"}],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0].text
    proc = _atlas("chat", "--model", str(qwen3_dir), "--max-tokens", "10", "--ignore-eos", "--kv-cache-memory", "8MiB",
                  stdin="hello\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "> " + expected + "\n> "


def test_log_level_works_before_or_after_the_sub_command():
    from atlas.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate"]).log_level == "info"
    assert parser.parse_args(["generate", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "error", "chat"]).log_level == "error"
    assert parser.parse_args(["serve", "--log-level", "warning"]).log_level == "warning"
    assert parser.parse_args(["bench", "serve", "--log-level", "debug"]).log_level == "debug"


def test_over_long_max_tokens_is_refused_as_the_server_refuses_it(qwen3_dir):
    """Same rule and same words as the server's 400 (shared code), with the flag's name; not given, the
    default is capped at what the context leaves (chat: 256 a reply)."""
    from atlas.cli import CHAT_DEFAULT_MAX_TOKENS, build_parser, prepare_prompt
    from atlas.errors import PromptTooLongError
    from atlas.sampling_params import resolve_max_tokens

    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB", max_model_len=64)
    n_prompt = len(llm.get_tokenizer().encode("def wrap(text):"))
    proc = _atlas("generate", "--model", str(qwen3_dir), "--prompt", "def wrap(text):", "--max-tokens", "100",
                  "--kv-cache-memory", "8MiB", "--max-model-len", "64")
    assert proc.returncode == 2 and proc.stdout == ""
    with pytest.raises(PromptTooLongError) as info:
        resolve_max_tokens(100, 128, n_prompt, 64, "--max-tokens")
    assert proc.stderr.strip().endswith(f"error: {info.value}")
    assert f"--max-tokens may be at most {64 - n_prompt} here" in proc.stderr

    parser = build_parser()
    _, params = prepare_prompt(llm.engine, "def wrap(text):", parser.parse_args(["generate"]))
    assert params.max_tokens == 64 - n_prompt  # 128 by default, capped
    chat = parser.parse_args(["chat"])
    assert chat.max_tokens is None and chat.default_max_tokens == CHAT_DEFAULT_MAX_TOKENS == 256
    _, params = prepare_prompt(llm.engine, [5] * 10, chat)
    assert params.max_tokens == 64 - 10
    with pytest.raises(PromptTooLongError, match="--max-tokens may be at most 54"):
        prepare_prompt(llm.engine, [5] * 10, parser.parse_args(["chat", "--max-tokens", "55"]))


def test_ctrl_c_stops_the_reply_and_keeps_the_chat(qwen3_dir):
    """Ctrl-C during a reply ends that reply (the request is aborted between steps) and the chat goes on,
    with the partial reply in its history."""
    proc = subprocess.Popen([*slow_atlas_command(0.02), "--log-level", "warning", "chat", "--model",
                             str(qwen3_dir), "--kv-cache-memory", "8MiB", "--ignore-eos", "--max-tokens", "80"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0)
    try:
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        head = proc.stdout.read(3)  # the prompt, then the reply has started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("again\n\n", timeout=120)
        out = head + out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "[reply stopped]" in err and "Traceback" not in err
    assert out.startswith("> ") and out.endswith("\n> ") and out.count("\n> ") == 2, out
    partial, second = out[2:-3].split("\n> ")
    llm = LLM(str(qwen3_dir), kv_cache_memory="8MiB")
    greedy = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    full = llm.chat([{"role": "user", "content": "hello"}], greedy)[0].outputs[0].text
    assert partial and full.startswith(partial) and len(partial) < len(full)
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": partial}]
    expected = llm.chat([*history, {"role": "user", "content": "again"}], greedy)[0].outputs[0].text
    assert second == expected


def test_a_stuck_group_teardown_ends_the_process_with_the_commands_status():
    """When leaving the process groups timed out (a thread stuck in the collectives library), the CLI ends
    the process itself after flushing, with the command's status, instead of an abort at exit."""
    code = ("import atlas.runtime.parallel_groups as p; p.GROUPS_LEFT_HANGING = True\n"
            "from atlas.cli import _exit_if_stuck\n"
            "print('done', end='')\n"
            "_exit_if_stuck(3)\n"
            "print('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "done")
    code = "from atlas.cli import _exit_if_stuck; import sys; sys.exit(_exit_if_stuck(0) + 5)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 5  # (not stuck: returns)


def test_vllm_launch_lines_carry_over(capsys):
    """`atlas serve MODEL` as `vllm serve MODEL`; flags match whole (a vLLM flag Atlas lacks is not taken for
    another: --chat-template was read as --chat-template-timeout); `atlas --version`."""
    from atlas.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "Qwen/Qwen3-0.6B"]).model_tag == "Qwen/Qwen3-0.6B"
    assert parser.parse_args(["serve", "--model", "m"]).model_tag is None
    assert parser.parse_args(["serve", "--chat-template", "x.jinja"]).chat_template == "x.jinja"  # (not the timeout)
    assert parser.parse_args(["serve", "m", "--kv-cache-memory-bytes", "4294967296"]).kv_cache_memory == "4294967296"
    for argv in (["serve", "--chat-template-time", "3"], ["generate", "--max-tok", "3"], ["bench", "serve", "--conc", "2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert capsys.readouterr().out.startswith("atlas ")
    proc = _atlas("serve", "some/model", "--model", "other/model")
    assert proc.returncode == 2 and "two models given" in proc.stderr


def test_a_broken_sub_command_import_fails_loudly(tmp_path, monkeypatch):
    """A sub-command whose module fails to import inside Atlas (a module or name of atlas missing, as a broken
    import inside atlas.bench would be) raises the real error: the command never vanishes from `atlas`."""
    import atlas.cli as cli

    monkeypatch.setitem(sys.modules, "atlas.bench.cli", None)  # (importing it fails as a missing atlas module)
    with pytest.raises(ModuleNotFoundError, match="atlas.bench.cli"):
        cli.build_parser()
    monkeypatch.delitem(sys.modules, "atlas.bench.cli")
    (tmp_path / "atlas_test_broken_command.py").write_text("from atlas.config import NoSuchName\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, ("atlas_test_broken_command", "broken", "server")))
    with pytest.raises(ImportError, match="NoSuchName"):
        cli.build_parser()


def test_a_missing_optional_package_names_the_package_and_the_extra(tmp_path, monkeypatch, capsys):
    """A sub-command whose module needs a third-party package that is not installed stays listed; running it
    (whatever its flags) says which package is missing and which pip extra installs it."""
    import atlas.cli as cli

    (tmp_path / "atlas_test_needy_command.py").write_text("import atlas_test_no_such_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, ("atlas_test_needy_command", "needy", "server")))
    assert "needy" in cli.build_parser().commands
    assert cli.main(["needy", "--model", "x", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "atlas needy needs the Python package 'atlas_test_no_such_package'" in err
    assert "pip install 'atlas[server]'" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "needy" in capsys.readouterr().out


def test_serve_without_the_server_extras_names_them():
    code = ("import sys\nsys.modules['fastapi'] = None\nfrom atlas.cli import main\n"
            "sys.exit(main(['--log-level', 'warning', 'serve', '--model', 'x']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "atlas serve needs the server extras (fastapi missing)" in proc.stderr and "atlas[server]" in proc.stderr


def test_front_end_count_defaults_to_two_on_large_hosts_only(monkeypatch):
    """`atlas serve` without --api-server-count: one front end on small hosts (CI's 2 cores), two where the cores
    exist (one front end streaming to 256 clients holds the engine back: BENCHMARKS.md section 4)."""
    from atlas.server.cli import default_api_server_count

    for cpus, want in ((2, 1), (7, 1), (8, 2), (128, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)), raising=False)
        assert default_api_server_count() == want
