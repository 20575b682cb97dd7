"""A shell script's one-shot prompt imports only what it uses: not the HTTP server, not ARCA, not the
grammar compilers, not the download machinery (each costs every start its import time). A module
added to the one-shot path must be added below on purpose."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Every module of Reame a one-shot prompt on a model already on disk may import.
ALLOWED = frozenset("""
reame reame.answers reame.assembly reame.autoconfig reame.cache reame.cache.answers reame.cache.codec
reame.cache.heads reame.cache.prefix reame.cache.store
reame.catalog reame.chat reame.cli reame.cli_flags reame.conclave reame.config reame.ctypes_llama
reame.ctypes_llama._lib reame.ctypes_llama.api reame.ctypes_llama.types reame.engine reame.engine.admission
reame.engine.embeddings reame.engine.interruption
reame.engine.kv reame.engine.prompt reame.engine.request reame.engine.scheduler reame.engine.sequences
reame.engine.slots reame.engine.step reame.engine.textstream reame.errors reame.fetch reame.files reame.gguf reame.model
reame.model.backend reame.model.batch_numerics reame.model.chat_template reame.model.embedding
reame.model.fingerprint reame.model.library reame.model.llama reame.model.loaded_model reame.model.sampler_chain
reame.model.sampling reame.model_choice reame.native reame.oneshot reame.quantize reame.settings
reame.speculative reame.speculative.archive reame.speculative.checkpoint reame.speculative.controller
reame.speculative.draft_model
reame.speculative.lookup reame.speculative.palimpsest reame.speculative.source reame.speculative.speculation
reame.speculative.suggeritore reame.structured reame.structured.gbnf reame.structured.grammar
""".split())
# Standard-library packages only a server, a store client or a download needs.
NOT_FOR_ONE_SHOT = ("http", "socket", "ssl", "email", "select", "selectors", "asyncio", "urllib.request",
                    "subprocess", "xml", "sqlite3", "hmac", "secrets")

LIST_IMPORTS = """
import atexit, runpy, sys
atexit.register(lambda: print("MODULES", *sorted(sys.modules), file=sys.stderr))
sys.argv = ["reame", *sys.argv[1:]]
runpy.run_module("reame", run_name="__main__", alter_sys=True)
"""


def imported_by(*args: str) -> set[str]:
    result = subprocess.run([sys.executable, "-c", LIST_IMPORTS, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stderr.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:])


def test_a_one_shot_prompt_imports_only_what_it_uses(smollm2_path):
    modules = imported_by("run", str(smollm2_path), "Hi", "--max-tokens", "1", "-q")
    ours = {name for name in modules if name == "reame" or name.startswith("reame.")}
    assert ours - ALLOWED == set()
    assert "reame.cli" in ours and "reame.model.llama" in ours
    assert sorted(name for name in modules if name.startswith(NOT_FOR_ONE_SHOT)) == []
    assert "jinja2" in modules  # the model's own chat template is rendered


def test_a_repeated_prompt_answered_from_the_cache_imports_neither_libllama_nor_the_engine(smollm2_path, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("REAME_CACHE_ANSWERS_DIR", str(tmp_path / "answers"))
    args = ("run", str(smollm2_path), "Name a color.", "--max-tokens", "4", "--temp", "0", "-q")
    imported_by(*args)
    modules = imported_by(*args)
    assert not {name for name in modules if name.startswith(("reame.engine", "reame.model.llama", "reame.speculative",
                                                             "reame.model.loaded_model", "reame.ctypes_llama.api",
                                                             "reame.conclave", "jinja2"))}


def test_a_raw_prompt_does_not_import_jinja2(smollm2_path):
    modules = imported_by("run", str(smollm2_path), "Hi", "--max-tokens", "1", "-q", "--raw")
    assert not {name for name in modules if name.startswith("jinja2") or name == "reame.model.chat_template"}


def test_asked_for_a_schema_the_schema_compiler_loads(smollm2_path, tmp_path):
    """The other side of the list: asked for, the compilers load (and the test above would see them)."""
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    modules = imported_by("run", str(smollm2_path), "Hi", "--max-tokens", "4", "-q", "--json-schema", str(schema))
    assert "reame.structured.json_schema" in modules and "reame.structured.json_schema" not in ALLOWED


def test_a_reader_that_stops_early_gets_no_traceback(smollm2_path):
    """`reame run … | head -1`: the pipe closes under the answer; the run ends with status 1, quietly."""
    process = subprocess.Popen([sys.executable, "-m", "reame", "run", str(smollm2_path), "Count from 1 to 50.",
                                "--max-tokens", "64", "--temp", "0", "-q"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_the_answer_is_whole_when_the_process_leaves_without_finalising(smollm2_path):
    """The process skips the interpreter's teardown after the answer: stdout is flushed first."""
    result = subprocess.run([sys.executable, "-m", "reame", "run", str(smollm2_path), "Count from 1 to 20.",
                             "--max-tokens", "48", "--temp", "0", "-q"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and len(result.stdout.strip()) > 20
