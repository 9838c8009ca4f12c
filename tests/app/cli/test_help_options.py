"""Every option a subcommand's --help lists is one that subcommand accepts: for each, the command runs
in-process with a minimal valid argv plus that option, through its own argument checks, up to the point
where it would load a model, reach a server or measure (a stand-in raises ``Accepted`` there). A
refused option (a one-line error, exit code 2) fails the test. And `localctx --version`."""
from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from localctx.app import cli as cli_module
from localctx.app import session_options
from localctx.app.commands import bench, chat, eval as eval_command, plan, pull, run, serve

ROOT = Path(__file__).resolve().parents[3]
SAVED_BENCH = ROOT / "docs" / "results" / "bench" / "bench.json"
URL = "http://127.0.0.1:9/v1"  # never reached: open_remote is stood in for
REMOTE = ["--backend", "openai", "--endpoint", URL]


class Accepted(Exception):
    """Raised where the command, its arguments checked, would start the real work."""


def help_text(capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli_module.main([*words, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def listed_options(text: str) -> list[tuple[str, bool]]:
    """(the option's long name, or its only name; whether it takes a value) for each option in a
    --help text, -h/--help left out."""
    out = []
    for line in text.splitlines():
        if not re.match(r"^  -", line):
            continue
        head = line.strip().split("  ")[0]  # "-m MODEL, --model MODEL" / "--exact" / "--kv POLICY"
        names = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", head)
        if "--help" in names:
            continue
        name = next((n for n in names if n.startswith("--")), names[0])
        takes_value = bool(re.search(re.escape(name) + r" \S", head))
        out.append((name, takes_value))
    return out


def verbs(text: str) -> list[str]:
    """The sub-verbs a --help lists under its positional arguments ("    ls   list ..."), if any."""
    section = text.split("positional arguments:")[-1].split("options:")[0] if "positional arguments:" in text else ""
    return re.findall(r"(?m)^    ([\w-]+) ", section)


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "in" / "note.txt"
    path.parent.mkdir()
    path.write_text("A short note about KV caches.\n")
    return path


def base_argv(command: str, tmp_path: Path, doc: Path) -> list[str]:
    """A minimal argv that the command accepts, on the test suite's fake backend where it takes one."""
    return {
        "run": ["run", "--backend", "fake", "hi"],
        "chat": ["chat", "--backend", "fake"],
        "summarize": ["summarize", str(doc), "--out", str(tmp_path / "out"), "--backend", "fake"],
        "plan": ["plan", "--backend", "fake"],
        "serve": ["serve", "--backend", "fake", "--port", "0"],
        "eval": ["eval", "--backend", "llamacpp"],
        "bench": ["bench", "--backend", "llamacpp", "--out", str(tmp_path / "bench")],
        "models": ["models"],
        "pull": ["pull", "HuggingFaceTB/SmolLM2-135M-Instruct"],
        "cache ls": ["cache", "ls"],
        "cache rm": ["cache", "rm", "no-such-entry"],
        "cache clear": ["cache", "clear"],
    }[command]


def option_argv(command: str, option: str, takes_value: bool, tmp_path: Path) -> list[str]:
    """The option with a valid value, and the options it needs beside it."""
    from localctx.backends.models.ref import bundled_default_path

    per_command = {
        ("serve", "--timeout"): ["--timeout", "30"],
        ("eval", "--backend"): ["--backend", "torch"],
        ("eval", "--kv"): ["--kv", "int8"],
        ("eval", "--no-baseline"): ["--no-baseline", "--kv", "int8"],
        ("eval", "--threads"): ["--threads", "1"],
        ("eval", "--tasks"): ["--tasks", "niah_multikey,vt"],
        ("eval", "--lengths"): ["--tasks", "vt", "--lengths", "2048,4096"],
        ("eval", "--samples"): ["--tasks", "cwe", "--samples", "2"],
        ("bench", "--backend"): ["--backend", "llamacpp"],
        ("bench", "--kv"): ["--kv", "fp16,int8"],
        ("bench", "--from-json"): ["--from-json", str(SAVED_BENCH), "--no-plots"],
        ("bench", "--doc"): ["--doc", str(tmp_path / "page.md")],
        ("models", "--json"): ["--json"],
        ("plan", "--calibrate-quality"): ["--calibrate-quality", "--backend", "llamacpp"],
    }
    samples = {
        "--model": ["-m", str(bundled_default_path())],
        "--backend": ["--backend", "fake"],
        "--endpoint": REMOTE,
        "--timeout": [*REMOTE, "--timeout", "30"],
        "--kv": ["--kv", "int8"],
        "--context": ["--context", "512"],
        "--min-tok-s": ["--min-tok-s", "1"],
        "--max-memory": ["--max-memory", "4GB"],
        "--max-kld": ["--max-kld", "0.2"],
        "--cache-reuse": ["--backend", "llamacpp", "--cache-reuse", "64"],
        "--system": ["--system", "Be brief."],
        "--max-tokens": ["--max-tokens", "8"],
        "--temperature": ["--temperature", "0.5"],
        "--top-p": ["--top-p", "0.9"],
        "--top-k": ["--top-k", "5"],
        "--seed": ["--seed", "1"],
        "--stop": ["--stop", "\n\n"],
        "--speculate": ["--speculate", "ngram"],
        "--out": ["--out", str(tmp_path / "elsewhere")],
        "--mode": ["--mode", "refine"],
        "--summary-tokens": ["--summary-tokens", "64"],
        "--chunk-tokens": ["--chunk-tokens", "256"],
        "--batch": ["--batch", "2"],
        "--hardware": ["--hardware", "rtx4090"],
        "--prompt-tokens": ["--prompt-tokens", "2048"],
        "--cached-tokens": ["--prompt-tokens", "2048", "--cached-tokens", "1024"],
        "--host": ["--host", "127.0.0.1"],
        "--port": ["--port", "0"],
        "--api-key": ["--api-key", "k"],
        "--parallel": ["--parallel", "2"],
        "--queue": ["--queue", "4"],
        "--max-body": ["--max-body", "65536"],
        "--allow-host": ["--allow-host", "box.lan"],
        "--cors": ["--cors", "http://localhost:3000"],
        "--kv-lanes": ["--kv-lanes", "6"],
        "--tokens": ["--tokens", "256"],
        "--chunk": ["--chunk", "64"],
        "--score-from": ["--score-from", "16"],
        "--segment": ["--segment", "128"],
        "--needle-lengths": ["--needle-lengths", "256"],
        "--needle-depths": ["--needle-depths", "0.5"],
        "--contexts": ["--contexts", "256,1k"],
        "--runs": ["--runs", "1"],
        "--gen-tokens": ["--gen-tokens", "4"],
        "--max-minutes": ["--max-minutes", "1"],
        "--note": ["--note", "a remark"],
        "--include": ["--include", "*.gguf"],
        "--revision": ["--revision", "main"],
    }
    if option == "--json-schema":  # run: a schema file that exists
        schema = tmp_path / "answer.schema.json"
        schema.write_text('{"type": "object", "properties": {"city": {"type": "string"}}}')
        return ["--json-schema", str(schema)]
    if (command, option) in per_command:
        return per_command[(command, option)]
    if option in samples:
        return samples[option]
    assert not takes_value, f"localctx {command} {option}: give the test a valid value for it (samples above)"
    return [option]


@pytest.fixture
def stand_ins(monkeypatch):
    """Where each command would start loading, connecting or measuring, it raises Accepted instead."""
    def accepted(*args, **kwargs):
        raise Accepted

    def checked_then_accepted(real):
        def run(*args, **kwargs):
            real(*args, **kwargs)  # every refusal of the arguments happens in here
            raise Accepted
        return run

    from localctx.backends.openai import session as remote

    monkeypatch.setattr(remote, "open_remote", accepted)
    planned = checked_then_accepted(session_options.plan_session)
    for module in (session_options, chat, serve, run):  # summarize reaches it through open_session
        monkeypatch.setattr(module, "plan_session", planned)
    monkeypatch.setattr(eval_command, "resolve_model", checked_then_accepted(eval_command.resolve_model))
    monkeypatch.setattr(bench, "resolve_model", checked_then_accepted(bench.resolve_model))
    monkeypatch.setattr(plan, "calibrate_and_save", accepted)
    from localctx.backends.evaluation import calibrate_quality

    monkeypatch.setattr(calibrate_quality, "calibrate", accepted)
    monkeypatch.setattr(pull, "hub_offline", lambda: False)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: "/nowhere")


def every_command(capsys) -> list[str]:
    out = []
    for name in cli_module.COMMANDS:
        out += [f"{name} {verb}" for verb in verbs(help_text(capsys, name))] or [name]
    return out


def test_every_listed_option_is_accepted_by_its_command(capsys, monkeypatch, tmp_path, doc, stand_ins):
    commands = every_command(capsys)
    assert {"serve", "run", "chat", "summarize", "plan", "eval", "bench", "cache ls"} <= set(commands)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # nothing piped: run's prompt is its argument
    refused, tried = [], 0
    for command in commands:
        options = listed_options(help_text(capsys, *command.split()))
        assert options or command.startswith("cache"), f"no options found in localctx {command} --help"
        for option, takes_value in options:
            argv = base_argv(command, tmp_path, doc) + option_argv(command, option, takes_value, tmp_path)
            tried += 1
            try:
                code = cli_module.main(argv)
            except Accepted:
                code = 0
            except SystemExit as exc:  # argparse refused it
                code = exc.code
            err = capsys.readouterr().err
            if code != 0 and not (command == "cache rm" and "no-such-entry" in err):
                refused.append(f"localctx {' '.join(argv)}: exit {code}: {err.strip()}")
    assert not refused, "\n".join(refused)
    assert tried > 60  # the walk found the options (run alone lists 20)


def test_serve_offers_only_a_local_backend(capsys, cli):
    text = help_text(capsys, "serve")
    assert "--endpoint" not in text and "openai" not in text
    assert "--timeout" in text and "--backend" in text
    result = cli("serve", "--backend", "openai")  # typed anyway: still one line, exit 2
    assert result.code == 2 and "runs a local model" in result.err


def test_the_remote_options_stay_where_the_openai_backend_runs(capsys):
    for command in ("run", "chat", "summarize", "plan"):
        names = [name for name, _ in listed_options(help_text(capsys, command))]
        assert "--endpoint" in names and "--timeout" in names, command
    for command in ("eval", "bench", "serve"):
        assert "--endpoint" not in help_text(capsys, command), command


def test_version_prints_the_projects_version(cli):
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'(?m)^version = "([^"]+)"', pyproject).group(1)
    result = cli("--version")
    assert result.code == 0 and result.out.strip() == f"localctx {version}"


def test_version_falls_back_to_the_installed_metadata(monkeypatch, tmp_path):
    """Run from where no pyproject.toml lies beside the sources (a wheel install): the metadata."""
    from importlib.metadata import version

    fake_file = tmp_path / "localctx" / "app" / "cli.py"
    monkeypatch.setattr(cli_module, "__file__", str(fake_file))
    assert cli_module.package_version() == version("localctx")


def test_the_readme_lists_every_run_option(capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = readme.split("Options of `run`")[1].split("\n\n")[0]
    missing = [name for name, _ in listed_options(help_text(capsys, "run")) if f"`{name}" not in paragraph
               and f"/{name}" not in paragraph]
    assert not missing, f"README.md's options of `run` leave out {', '.join(missing)}"
