"""The shim's mapping of llama-server's command line onto Reame's (bench/llama_server_shim.py)."""

from pathlib import Path

import pytest

from bench.llama_server_shim import context_per_request, parsed, reame_command


@pytest.mark.parametrize("argv,expected", [
    (["--ctx-size", "512", "--parallel", "2"], 256),  # each slot its own stream: the context over the slots
    (["--ctx-size", "512", "--parallel", "2", "--kv-unified"], 0),  # one pool any slot may fill
    (["--ctx-size", "512"], 0),  # slots left to the server (llama-server's auto: unified)
    (["--ctx-size", "512", "--parallel", "1"], 0),
    (["--ctx-size", "4096", "--parallel", "4", "--kv-unified", "--kv-unified-per-slot", "1000"], 1000),
])
def test_llama_servers_context_per_slot_is_reames_context_per_request(argv, expected):
    args, _ = parsed(argv)
    assert context_per_request(args) == expected
    _, env = reame_command(args, Path("model.gguf"))
    assert env.get("REAME_SERVER_CONTEXT_PER_REQUEST") == (str(expected) if expected else None)
