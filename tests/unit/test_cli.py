"""CLI input errors: one line on stderr, exit code 2, and no model is loaded."""

import io

import pytest

from reame import cli


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


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, err = run([], capsys)
    assert code == 2 and "run" in err and out == ""


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


def test_missing_or_empty_prompt_is_a_usage_error(tmp_path, capsys, monkeypatch):
    code, _, err = run(["run", "smollm2", "--quiet"], capsys)
    assert code == 2 and "no prompt" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("   \n"))
    code, _, err = run(["run", "smollm2", "-"], capsys)
    assert code == 2 and "empty" in err
