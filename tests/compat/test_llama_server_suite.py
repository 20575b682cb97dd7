"""llama.cpp's own server tests (tools/server/tests at the pin) run against Reame through the shim that maps
llama-server's flags and model downloads to Reame's (bench/server_tests.py, bench/llama_server_shim.py):
every test in tests/compat/llama_server_passing.txt must pass, so what Reame answers as llama-server does
stays so. bench/server_tests.py runs the same tests against llama-server beside it and prints both counts;
docs/api.md says why each test Reame fails fails."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from server_tests import FILES, extract_tests, run  # noqa: E402

PASSING = ROOT / "tests" / "compat" / "llama_server_passing.txt"


def expected() -> list[str]:
    return [line.strip() for line in PASSING.read_text().splitlines() if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def outcomes(native_libraries, model_path, tmp_path_factory):
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "all-minilm-l6-v2"):
        model_path(name)  # the shim's stand-ins, fetched and verified before any server starts
    tests = extract_tests(tmp_path_factory.mktemp("llama-server-tests"))
    files = sorted({test.split("::")[0] for test in expected()})
    assert set(files) <= set(FILES)
    return run(tests, "reame", files, "", timeout_s=1800)


def test_what_reame_passed_of_llama_servers_own_tests_it_still_passes(outcomes):
    # A test llama.cpp's suite skips on this machine (test_server_multiple_addresses without an IPv6 loopback)
    # says nothing of Reame.
    regressed = {test: outcomes.get(test, {"outcome": "missing", "message": ""}) for test in expected()
                 if outcomes.get(test, {}).get("outcome") not in ("passed", "skipped")}
    assert regressed == {}
