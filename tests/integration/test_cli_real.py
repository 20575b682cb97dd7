"""`python -m reame run` end to end on the real model."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def reame(*args, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "reame", *args], capture_output=True, text=True,
                          input=stdin, env=env, timeout=300)


def test_one_shot_prompt_streams_the_answer_and_a_stats_line(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "What is the capital of France? Answer in one word.", "--temp", "0",
                   "--max-tokens", "24", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt" in result.stderr and "tok/s" in result.stderr and "generated" in result.stderr


def test_quiet_prints_only_the_answer_and_reads_stdin(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "-", "--temp", "0", "--max-tokens", "8", "--quiet",
                   stdin="Say hello.")
    assert result.returncode == 0
    assert result.stdout.strip() and result.stderr == ""


def test_raw_mode_skips_the_chat_template(native_libraries, smollm2_path):
    templated = reame("run", str(smollm2_path), "The sky is", "--temp", "0", "--max-tokens", "8", "-q")
    raw = reame("run", str(smollm2_path), "The sky is", "--temp", "0", "--max-tokens", "8", "-q", "--raw")
    assert templated.returncode == raw.returncode == 0
    assert templated.stdout != raw.stdout


def test_chat_from_a_pipe_keeps_the_conversation(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "--temp", "0", "--max-tokens", "24",
                   stdin="My name is Ada.\n/help\nWhat is my name?\n/exit\n")
    assert result.returncode == 0, result.stderr
    answers = result.stdout.strip().split("\n")
    assert len(answers) == 2, answers  # one line per answer; prompts and help stay out of stdout
    assert "/reset" in result.stderr
    alone = reame("run", str(smollm2_path), "What is my name?", "--temp", "0", "--max-tokens", "24", "-q")
    assert alone.stdout.strip() != answers[1]  # the second answer saw the first exchange


def test_print_config_shows_every_choice_and_why(native_libraries, smollm2_path):
    result = reame("run", str(smollm2_path), "--print-config", "--ctx", "1024")
    assert result.returncode == 0
    assert "model.context_length = 1024  # set explicitly" in result.stdout
    assert "model.threads = " in result.stdout and "memory.kv_cache_type = f16" in result.stdout
    assert "server.parallel = 4  # when serving" in result.stdout
    explicit = reame("run", str(smollm2_path), "--print-config", "--parallel", "2")
    assert "server.parallel = 2  # set explicitly" in explicit.stdout


def test_config_mode_completes_raw_text(native_libraries, smollm2_path, tmp_path):
    conf = tmp_path / "reame.conf"
    conf.write_text(f"[model]\npath = {smollm2_path}  # the test model\ncontext_length = 1024\n"
                    "[generation]\ntemperature = 0\nmax_tokens = 8\n")
    result = reame("--config", str(conf), "--prompt", "The capital of France is", "-q")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_pull_list_and_run_from_a_clean_home(native_libraries, smollm2_path, tmp_path):
    from reame.native import cache_root
    env = {"HOME": str(tmp_path), "REAME_CACHE": str(cache_root())}  # reuse fetched wheels: no network
    pulled = reame("pull", "smollm2-135m", env=env)
    assert pulled.returncode == 0, pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path == tmp_path / ".reame" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
    listed = reame("list", env=env)
    assert "verified" in listed.stdout and "not downloaded" in listed.stdout  # smollm2 yes, the others no
    answered = reame("run", "smol", "Say hello.", "--temp", "0", "--max-tokens", "8", "-q", env=env)
    assert answered.returncode == 0 and answered.stdout.strip()


def test_json_schema_flag_answers_with_json_the_schema_accepts(native_libraries, smollm2_path, tmp_path):
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(schema))
    result = reame("run", str(smollm2_path), "Describe Paris as JSON.", "--json-schema", str(schema_file),
                   "--temp", "0", "--max-tokens", "64", "-q")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)


def test_grammar_flag_constrains_the_answer(native_libraries, smollm2_path, tmp_path):
    grammar_file = tmp_path / "yesno.gbnf"
    grammar_file.write_text('root ::= ("yes" | "no") "."\n')
    result = reame("run", str(smollm2_path), "Is the sky green?", "--grammar", str(grammar_file),
                   "--temp", "0.8", "--seed", "7", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("yes.", "no.")


def test_a_repeated_one_shot_prompt_is_answered_from_disk(native_libraries, smollm2_path):
    """A shell script's repeat: the second run prints the first answer without generating (greedy here;
    the default seeded sampling is deterministic too)."""
    args = ("run", str(smollm2_path), "Name a primary color.", "--temp", "0", "--max-tokens", "12")
    first, second = reame(*args), reame(*args)
    assert first.returncode == second.returncode == 0, second.stderr
    assert "generated" in first.stderr and "answered from the exact answer cache" in second.stderr
    assert second.stdout == first.stdout and first.stdout.strip()


def test_config_mode_shares_answers_through_the_originals_arca_address(native_libraries, smollm2_path, tmp_path):
    """As the original's shell scripts used it: `reame --config FILE --prompt TEXT` on two machines (each
    its own disk) with `[arca] remote = host:port`; the second answers from the store."""
    from tests.arca_thread import arca_thread
    with arca_thread(tmp_path / "arca") as port:
        conf = tmp_path / "reame.conf"
        conf.write_text(f"[model]\npath = {smollm2_path}\nthreads = 2\n[generation]\ntemperature = 0\n"
                        f"max_tokens = 12\n[arca]\nremote = 127.0.0.1:{port}\n")
        runs = [reame("--config", str(conf), "--prompt", "The capital of Italy is",
                      env={"REAME_CACHE_ANSWERS_DIR": str(tmp_path / machine)}) for machine in ("one", "two")]
    assert [run.returncode for run in runs] == [0, 0], runs[1].stderr
    assert "generated" in runs[0].stderr and "answered from the exact answer cache" in runs[1].stderr
    assert runs[1].stdout == runs[0].stdout and runs[0].stdout.strip()
