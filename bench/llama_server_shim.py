#!/usr/bin/env python3
"""llama-server's command line, for llama.cpp's own server tests (bench/server_tests.py): the flags their
`ServerProcess` passes are mapped onto Reame's (`--target reame`, the default) or passed to the real
llama-server of the pinned build (`--target llama-server`), and the models they would download are replaced
by local stand-ins of this machine's catalog, the same for both targets:

    stories260K (tinyllama2)      -> smollm2-135m
    stories260K-infill            -> qwen2.5-coder-0.5b (a FIM model)
    bert-bge-small                -> all-minilm-l6-v2

A test whose model has no stand-in here (a MoE, a reranker, a vision model, the router's downloads) finds
the server exiting with NO_STAND_IN, and the runner counts it as needing a model this machine cannot have.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NO_STAND_IN = 3  # the exit status of a server asked for a model that has no local stand-in
STAND_INS = {"ggml-org/test-model-stories260K": "smollm2-135m", "ggml-org/models/tinyllamas/stories260K.gguf":
             "smollm2-135m", "ggml-org/test-model-stories260K-infill": "qwen2.5-coder-0.5b",
             "ggml-org/models/bert-bge-small/ggml-model-f16.gguf": "all-minilm-l6-v2"}
IGNORED_SWITCHES = ("--cont-batching", "--embedding", "--reranking", "--metrics", "--kv-unified", "--swa-full",
                    "--slots", "--no-slots", "--verbose", "--context-shift", "--no-ui", "--no-models-autoload",
                    "--jinja", "--no-jinja", "--no-mmproj", "--no-cache-idle-slots", "--ui-mcp-proxy",
                    "--backend_sampling", "--offline")


def parsed(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--target", choices=("reame", "llama-server"), default="reame")
    parser.add_argument("--llama-server", dest="llama_server_path", default="")
    for flag in ("--port", "--host", "--temp", "--seed", "--model", "--hf-repo", "--hf-file", "--alias", "--ctx-size",
                 "--parallel", "--n-predict", "--api-key", "--threads", "--batch-size", "--ubatch-size", "-ctk",
                 "-ctv", "-fa", "--slot-save-path", "--chat-template", "--chat-template-file", "--cache-ram",
                 "--reasoning-format", "--reasoning", "--pooling", "--cors-origins", "--tags", "--kv-unified-per-slot"):
        parser.add_argument(flag, dest=flag.lstrip("-").replace("-", "_"))
    for switch in IGNORED_SWITCHES:
        parser.add_argument(switch, action="store_true")
    return parser.parse_known_args(argv)


def stand_in(args: argparse.Namespace) -> Path | None:
    """The local GGUF standing in for the model the test asked for (None: none here)."""
    if args.model:
        return Path(args.model)
    name = STAND_INS.get(args.hf_repo if not args.hf_file else f"{args.hf_repo}/{args.hf_file}")
    if name is None:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from reame import catalog, fetch, native
    return fetch.ensure_model(catalog.resolve(name), native.cache_root() / "models")


def reame_command(args: argparse.Namespace, model: Path) -> tuple[list[str], dict[str, str]]:
    """`python -m reame run MODEL --serve` with what the flags ask, and the environment the rest needs."""
    command = [sys.executable, "-m", "reame", "run", str(model), "--serve", "--port", args.port or "8080",
               "--host", args.host or "127.0.0.1"]
    for flag, value in (("--ctx", args.ctx_size), ("--parallel", args.parallel), ("--threads", args.threads),
                        ("--batch", args.batch_size), ("--api-key", args.api_key), ("--temp", args.temp),
                        ("--seed", args.seed)):
        if value:
            command += [flag, value]
    # llama-server's --alias is a set of names whose least is the id: Reame's id first, then its other names.
    aliases = sorted({name.strip() for name in (args.alias or "").split(",") if name.strip()})
    env = {"REAME_SERVER_MODEL_ID": "|".join(aliases), "REAME_SERVER_MODEL_TAGS": args.tags or "",
           "REAME_CACHE_ANSWERS": "0",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if args.n_predict and int(args.n_predict) > 0:  # llama-server's default for a request that sets none
        env["REAME_GENERATION_MAX_TOKENS"] = args.n_predict
    if not args.metrics:  # llama-server serves /metrics only with --metrics
        env["REAME_SERVER_METRICS"] = "false"
    if args.no_slots:
        env["REAME_SERVER_SLOTS"] = "false"
    if args.no_ui:
        env["REAME_SERVER_WEB_PAGE"] = "false"
    if args.pooling:  # llama-server's --pooling: Reame's embeddings.pooling has the same names
        env["REAME_EMBEDDINGS_POOLING"] = args.pooling
    if args.chat_template:  # one of llama.cpp's formats by name (a Jinja text is not taken here)
        env["REAME_MODEL_CHAT_TEMPLATE"] = args.chat_template
    per_request = context_per_request(args)
    if per_request:
        env["REAME_SERVER_CONTEXT_PER_REQUEST"] = str(per_request)
    if args.ctk in ("f16", "q8_0", "q4_0"):
        command += ["--kv-type", args.ctk]
    return command, env


def context_per_request(args: argparse.Namespace) -> int:
    """llama-server's context per slot (0: the whole context): --kv-unified-per-slot, else with slots set and no
    --kv-unified each slot's own KV stream, the context over the slots. Reame's KV stays one pool either way."""
    if args.kv_unified_per_slot:
        return int(args.kv_unified_per_slot)
    if args.parallel and int(args.parallel) > 1 and args.ctx_size and not args.kv_unified:
        return int(args.ctx_size) // int(args.parallel)
    return 0


def llama_server_command(args: argparse.Namespace, argv: list[str], model: Path) -> list[str]:
    """The real llama-server with the test's own flags, the model a local file instead of a download."""
    skip = {"--hf-repo", "--hf-file", "--model", "--target", "--llama-server"}
    kept: list[str] = []
    items = iter(argv)
    for item in items:
        if item in skip:
            next(items, None)
        elif item != "--offline":
            kept.append(item)
    return [args.llama_server_path, "--model", str(model), *kept]


def main(argv: list[str]) -> int:
    args, _unknown = parsed(argv)
    model = stand_in(args)
    if model is None:
        print(f"shim: no local stand-in for {args.hf_repo} {args.hf_file or ''}", file=sys.stderr)
        return NO_STAND_IN
    if args.target == "llama-server":
        command = llama_server_command(args, argv, model)
        os.execv(command[0], command)
    command, env = reame_command(args, model)
    os.execve(command[0], command, {**os.environ, **env})
    return 0  # (not reached)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
