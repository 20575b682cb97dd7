"""CLI input errors: one line on stderr, exit code 2, and no model is loaded."""

import io
from pathlib import Path

import pytest

from reame import cli
from reame.config import ConfigChoice


def run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv", [
    ["run", "smollm2", "hi", "--temp", "hot"],
    ["run", "smollm2", "hi", "--max-tokens", "0"],
    ["run", "smollm2", "hi", "--seed", "-3"],
    ["run", "smollm2", "hi", "--ctx", "1.5"],
    ["run"],
    ["fly"],
])
def test_bad_flags_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(argv)
    assert raised.value.code == 2


def test_bare_reame_prints_its_version_and_where_to_start_and_exits_0_as_the_original_did(capsys):
    from reame import __version__
    code, out, err = run([], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"reame {__version__} (llama.cpp ") and 'reame run smollm2-135m "prompt"' in out
    assert "reame --serve" in out and "reame --print-config --serve" in out


def test_config_search_order_env_then_the_originals_default_then_user_and_system(tmp_path, monkeypatch):
    from reame.config import choose_config
    work, home = tmp_path / "work", tmp_path / "home"
    (work / "config").mkdir(parents=True)
    (home / ".config" / "reame").mkdir(parents=True)
    monkeypatch.chdir(work)
    user = home / ".config" / "reame" / "reame.conf"
    empty: dict[str, str] = {}
    nothing_here = choose_config(None, search=True, env=empty, home=home).path
    assert nothing_here in (None, Path("/etc/reame/reame.conf"))  # the system-wide one is this machine's
    user.write_text("")
    assert choose_config(None, search=True, env=empty, home=home) == ConfigChoice(user, f"found {user}")
    (work / "reame.conf").write_text("")
    assert choose_config(None, search=True, env=empty, home=home) == ConfigChoice(Path("reame.conf"),
                                                                                  "found ./reame.conf")
    (work / "config" / "reame.conf").mkdir()  # not a file: skipped
    assert choose_config(None, search=True, env=empty, home=home).path == Path("reame.conf")
    (work / "config" / "reame.conf").rmdir()
    (work / "config" / "reame.conf").write_text("")
    assert choose_config(None, search=True, env=empty, home=home) == ConfigChoice(Path("config/reame.conf"),
                                                                                  "found ./config/reame.conf")
    named = {"REAME_CONFIG": "/srv/mine.conf"}
    assert choose_config(None, search=True, env=named, home=home) == ConfigChoice(
        Path("/srv/mine.conf"), "REAME_CONFIG=/srv/mine.conf")
    assert choose_config("other.conf", search=True, env=named, home=home).path == Path("other.conf")
    assert choose_config(None, search=False, env=empty, home=home).path is None  # `reame run` does not search


def test_print_config_serve_says_which_file_and_which_model(tmp_path, capsys, monkeypatch):
    from tests.unit.test_gguf import GOOD
    model = tmp_path / "tiny.gguf"
    model.write_bytes(GOOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("REAME_CONFIG", raising=False)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "reame.conf").write_text(f"[model]\npath = {model}\n[server]\nport = 8099\n")
    code, out, err = run(["--print-config", "--serve"], capsys)
    assert code == 0, err
    assert out.startswith("# config file: config/reame.conf (found ./config/reame.conf)\n")
    assert f"model.path = {model}  # config/reame.conf:2" in out and "server.port = 8099  # config/reame.conf:4" in out
    assert "config: found ./config/reame.conf" in err


def test_without_a_config_the_default_model_is_named_with_its_reason(tmp_path, capsys, monkeypatch):
    from reame import model_choice
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("REAME_CONFIG", raising=False)
    monkeypatch.setattr("reame.config.config_locations", lambda home: (Path("config/reame.conf"),))
    wanted = []

    def resolve_model(name, progress=None):
        wanted.append(name)
        raise cli.ConfigError("stop here")
    monkeypatch.setattr(model_choice, "resolve_model", resolve_model)
    code, _, err = run(["-s"], capsys)
    assert code == 2 and wanted == ["smollm2-135m"]
    assert "config: no config file in ./config/reame.conf" in err
    assert "the catalog's default, smollm2-135m, as `reame run smollm2-135m --serve` would" in err


def test_unknown_model_suggests_catalog_names(capsys):
    code, out, err = run(["run", "no-such-model", "hi"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "smollm2-135m" in err and out == ""


@pytest.mark.parametrize("content", [b"", b"GGU", b"not a model at all", b"\x00" * 64])
def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    code, out, err = run(["run", str(path), "hi"], capsys)
    assert code == 2
    assert "not a GGUF" in err and err.strip().count("\n") <= 1


def test_a_directory_is_not_a_model(tmp_path, capsys):
    code, _, err = run(["run", str(tmp_path), "hi"], capsys)
    assert code == 2


def test_empty_prompt_is_a_usage_error(capsys, monkeypatch):
    code, _, err = run(["run", "smollm2", "  "], capsys)
    assert code == 2 and "empty" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("   \n"))
    code, _, err = run(["run", "smollm2", "-"], capsys)
    assert code == 2 and "empty" in err


def test_unknown_pull_name_is_a_usage_error(capsys):
    code, out, err = run(["pull", "nonexistent-model"], capsys)
    assert code == 2 and "unknown model" in err and out == ""


def test_bad_config_file_is_one_line_with_file_and_line(tmp_path, capsys):
    path = tmp_path / "reame.conf"
    path.write_text("[model]\nthreds = 2\n")
    code, _, err = run(["--config", str(path), "--prompt", "hi"], capsys)
    assert code == 2 and f"{path}:2" in err and "did you mean 'model.threads'" in err
    code, _, err = run(["run", "smollm2", "hi", "--config", str(tmp_path / "missing.conf")], capsys)
    assert code == 2 and "not found" in err


def test_config_mode_without_a_prompt_has_nothing_to_do(tmp_path, capsys):
    path = tmp_path / "reame.conf"
    path.write_text("[model]\npath = smollm2\n")
    code, out, err = run(["--config", str(path)], capsys)
    assert code == 0 and out == "" and "nothing to do" in err


def test_list_shows_the_catalog_and_what_is_on_disk(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REAME_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.gguf").write_bytes(b"GGUF")
    code, out, _ = run(["list"], capsys)
    assert code == 0
    assert "smollm2-135m" in out and "not downloaded" in out and str(tmp_path / "models" / "mine.gguf") in out


def test_serving_with_an_unreadable_key_file_is_a_usage_error(tmp_path, capsys):
    from tests.unit.test_gguf import GOOD
    model = tmp_path / "tiny.gguf"
    model.write_bytes(GOOD)
    conf = tmp_path / "reame.conf"
    conf.write_text(f"[model]\npath = {model}\n[server]\napi_key_file = {tmp_path / 'missing-keys'}\nport = 0\n")
    code, out, err = run(["--config", str(conf), "--serve"], capsys)
    assert code == 2 and "server.api_key_file" in err and out == ""


def test_dash_v_prints_the_version_in_one_line_as_the_original_did(capsys):
    from reame import __version__
    from reame.cli import main
    with pytest.raises(SystemExit) as raised:
        main(["-v"])
    assert raised.value.code == 0 and capsys.readouterr().out == f"reame {__version__}\n"


@pytest.mark.parametrize("flag,content,message", [
    ("--json-schema", "{not json", "is not JSON"),
    ("--json-schema", '{"type": "object", "properties": {"a": {"type": "frobnicate"}}}', "frobnicate"),
    ("--json-schema", '{"type": "string", "pattern": "^a+$"}', "pattern"),
    ("--grammar", 'root ::= "a" undefined-rule', "undefined-rule"),
    ("--grammar", 'root ::= "unterminated', "line 1, column 23: unterminated string"),
    ("--grammar", "", "empty"),
])
def test_a_bad_schema_or_grammar_is_refused_before_the_model_loads(tmp_path, capsys, flag, content, message):
    path = tmp_path / "answer.txt"
    path.write_text(content)
    code, out, err = run(["run", "no-such-model", "hi", flag, str(path)], capsys)
    assert code == 2 and out == ""
    assert message in err and err.strip().count("\n") == 0


def test_schema_and_grammar_together_are_refused(tmp_path, capsys):
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= "a"')
    code, _, err = run(["run", "smollm2", "hi", "--grammar", str(path), "--json-schema", str(path)], capsys)
    assert code == 2 and "not both" in err


@pytest.mark.parametrize("command", ["serve", "arca"])
def test_a_port_already_taken_is_one_line_not_a_traceback(tmp_path, capsys, command):
    import socket

    from tests.unit.test_gguf import GOOD
    model = tmp_path / "tiny.gguf"
    model.write_bytes(GOOD)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["run", str(model), "--serve", "--port", port] if command == "serve" else \
            ["arca", "--port", port, "--dir", str(tmp_path / "arca")]
        code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert f"reame: error: cannot listen on 127.0.0.1:{port}: address already in use" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, prompt", [
    (["run", "m", "-q", "--temp", "0", "-"], "-"),
    (["run", "m", "--temp", "0", "Write a haiku"], "Write a haiku"),
    (["run", "m", "Write a haiku", "--temp", "0"], "Write a haiku"),
    (["run", "m", "--temp", "0"], None),
])
def test_the_prompt_may_come_before_or_after_the_options(argv, prompt):
    assert cli.parse(cli.build_parser(), argv).prompt == prompt


@pytest.mark.parametrize("argv", [["run", "m", "a", "b"], ["run", "m", "--temp", "0", "--no-such-flag"],
                                  ["list", "extra"]])
def test_left_over_arguments_are_still_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        cli.parse(cli.build_parser(), argv)
    assert raised.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
