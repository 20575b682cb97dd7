"""Command line: `reame run MODEL "prompt"`.

Answers go to stdout, logs and the stats line to stderr. Exit codes: 0 success,
2 usage or bad input, 1 runtime failure. A user error is one line, never a
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from reame import __version__, catalog, fetch
from reame.engine import Engine, GenerationRequest, SamplingParams, TokenEvent
from reame.engine.backend import LlamaBackend, ModelSettings
from reame.errors import ConfigError, FetchError, ModelError, ModelFileError, ReameError, RequestError
from reame.native import LLAMA_COMMIT

log = logging.getLogger("reame")

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
USER_ERRORS = (ConfigError, RequestError, FetchError, ModelFileError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reame", description="CPU-first LLM inference on llama.cpp.")
    parser.add_argument("--version", action="version",
                        version=f"reame {__version__} (llama.cpp {LLAMA_COMMIT})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="answer a prompt with a model",
                              description="Answer one prompt with a model and print the answer.")
    run.add_argument("model", help="a catalog name (e.g. smollm2-135m) or a path to a .gguf file")
    run.add_argument("prompt", nargs="?", help="the prompt; '-' reads it from standard input")
    run.add_argument("--max-tokens", type=positive_int, default=512, help="most tokens to generate (512)")
    run.add_argument("--temp", type=non_negative_float, default=0.7,
                     help="sampling temperature; 0 is greedy (0.7)")
    run.add_argument("--seed", type=non_negative_int, default=42, help="sampling seed (42)")
    run.add_argument("--threads", type=positive_int, default=0, help="CPU threads (all usable cores)")
    run.add_argument("--ctx", type=positive_int, default=4096, help="context length in tokens (4096)")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("--quiet", "-q", action="store_true", help="print only the answer")
    return parser


def positive_int(text: str) -> int:
    value = _parse(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(text, float, "a number")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _parse(text: str, kind: type, what: str):  # type: ignore[no-untyped-def]
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None


def configure_logging(quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("reame: %(message)s"))
    root = logging.getLogger("reame")
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    root.propagate = False


def resolve_model_path(name: str) -> Path:
    """A catalog name (fetched on first use) or an existing file."""
    entry = catalog.resolve(name)
    if entry is not None:
        return fetch.ensure_model(entry)
    path = Path(name).expanduser()
    if path.is_file():
        return path
    hint = ", ".join(catalog.suggestions(name))
    raise ConfigError(f"unknown model '{name}' and no such file; catalog names: {hint}")


def read_prompt(prompt: str | None) -> str:
    if prompt is None:
        raise ConfigError("no prompt given: pass it as an argument, or '-' to read it from standard input")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ConfigError("the prompt is empty")
    return prompt


def command_run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    path = resolve_model_path(args.model)
    log.info("loading %s", path.name)
    settings = ModelSettings(str(path), n_ctx=args.ctx, n_threads=args.threads)
    with LlamaBackend(settings) as backend, Engine(backend) as engine:
        text = prompt if args.raw or not backend.has_chat_template else \
            engine.chat_prompt([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temp, seed=args.seed)
        handle = engine.submit(GenerationRequest(text, params))
        out = sys.stdout
        try:
            for event in handle:
                if isinstance(event, TokenEvent):
                    if event.text:
                        out.write(event.text)
                        out.flush()
        except KeyboardInterrupt:
            handle.cancel()
            for _ in handle:
                pass
        finish = handle.finish
        assert finish is not None
        out.write(finish.text + "\n")
        out.flush()
        if finish.reason == "error":
            raise ModelError(finish.message)
        if not args.quiet:
            print(stats_line(finish), file=sys.stderr)
    return EXIT_OK


def stats_line(finish) -> str:  # type: ignore[no-untyped-def]
    usage = finish.usage
    note = f" ({finish.message})" if finish.message else ""
    return (f"prompt {usage.prompt_tokens} tokens, {usage.prompt_tokens_per_second:.1f} tok/s · "
            f"generated {usage.completion_tokens} tokens, {usage.decode_tokens_per_second:.1f} tok/s · "
            f"finish {finish.reason}{note}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    configure_logging(getattr(args, "quiet", False))
    try:
        return command_run(args)
    except USER_ERRORS as error:
        print(f"reame: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ReameError as error:
        print(f"reame: error: {error}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("reame: interrupted", file=sys.stderr)
        return EXIT_RUNTIME
