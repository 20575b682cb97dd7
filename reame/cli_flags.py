"""The command line's flags and subcommands (argparse), what bare `reame` prints, and `--version`: what
`reame --help` shows. cli.py runs what they ask for."""

from __future__ import annotations

import argparse
from typing import Any

from reame import __version__, catalog
from reame.errors import ReameError
from reame.native import LLAMA_COMMIT
from reame.quantize import QUANT_TYPES


# --- argument types -------------------------------------------------------------------

def _parse(text: str, kind: type, what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None


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


# --- parser ---------------------------------------------------------------------------

def add_common_flags(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """Flags accepted before and after the subcommand (after it, they must not reset what came before)."""
    parser.add_argument("--max-tokens", type=positive_int, default=default, help="most tokens to generate (512)")
    parser.add_argument("--temp", type=non_negative_float, default=default,
                        help="sampling temperature; 0 is greedy (0.7)")
    parser.add_argument("--seed", type=non_negative_int, default=default, help="sampling seed (42)")
    parser.add_argument("--best-of", type=attempt_count, default=default, metavar="N",
                        help="the Conclave: N attempts from one prefill, the answer elected by vote; its "
                             "consensus goes to stderr as CONCLAVE consensus=k/N")
    parser.add_argument("--config", "-c", metavar="FILE", default=default,
                        help="INI config file (see docs/configuration.md)")
    parser.add_argument("--quiet", "-q", action="store_true", default=default or False,
                        help="print only the answer")


def attempt_count(text: str) -> int:
    from reame.conclave import MAX_ATTEMPTS  # the Conclave imports the engine: only when --best-of is given
    value = positive_int(text)
    if value > MAX_ATTEMPTS:
        raise argparse.ArgumentTypeError(f"at most {MAX_ATTEMPTS} attempts, got {value}")
    return value


def add_server_flags(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument("--serve", "-s", action="store_true", default=default or False,
                        help="serve the OpenAI-compatible API instead of answering")
    parser.add_argument("--host", default=default, help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=non_negative_int, default=default, help="TCP port (8080)")
    parser.add_argument("--api-key", action="append", default=default,
                        help="bearer key clients must send (repeatable)")
    parser.add_argument("--parallel", type=positive_int, default=default,
                        help="sequences generated together when serving (chosen: 4)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reame", description="CPU-first LLM inference on llama.cpp.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config mode: reame --serve | --prompt TEXT | --print-config [--config FILE]. Without --config: "
               "$REAME_CONFIG, else the first of ./config/reame.conf, ./reame.conf, ~/.config/reame/reame.conf, "
               f"/etc/reame/reame.conf; with none, the model {catalog.DEFAULT_MODEL}.")
    parser.add_argument("--version", action=VersionAction, nargs=0, help="version, llama.cpp pin, build in use")
    parser.add_argument("-v", action="version", version=f"reame {__version__}",
                        help="the version in one line, as the original Reame printed it")
    parser.add_argument("--prompt", "-p", help="config mode: complete this text (raw, no chat template)")
    parser.add_argument("--print-config", action="store_true",
                        help="config mode: show the config file found, every setting and why, then exit")
    add_common_flags(parser)
    add_server_flags(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = commands.add_parser("run", help="answer a prompt, or chat, with a model",
                              description="Answer one prompt (or chat when none is given) with a model.")
    run.add_argument("model", help="a catalog name (see `reame list`) or a path to a .gguf file")
    run.add_argument("prompt", nargs="?", help="the prompt; '-' reads it from standard input; none: chat")
    add_common_flags(run, default=argparse.SUPPRESS)
    run.add_argument("--threads", type=positive_int, help="CPU threads (chosen for this host)")
    run.add_argument("--ctx", type=positive_int, help="context length in tokens (chosen for host and model)")
    run.add_argument("--kv-type", choices=("f16", "q8_0", "q4_0"), help="KV cache type (chosen for the host)")
    run.add_argument("--batch", type=positive_int, help="most tokens per decode call (512)")
    run.add_argument("--system", help="a system message for the chat template")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    run.add_argument("--json-schema", metavar="FILE",
                     help="answer with JSON this schema accepts (a JSON Schema file; for scripts)")
    run.add_argument("--grammar", metavar="FILE", help="answer with text this GBNF grammar accepts")
    run.add_argument("--draft-model", metavar="MODEL",
                     help="a smaller model with the same vocabulary that drafts tokens (catalog name or path)")
    run.add_argument("--print-config", action="store_true", default=argparse.SUPPRESS,
                     help="show every setting and why, then exit")
    add_server_flags(run, default=argparse.SUPPRESS)

    warm = commands.add_parser("warm", help="prefill documents into the prefix cache ahead of time",
                               description="Prefill documents into the persistent prefix cache (e.g. nightly), "
                                           "so that later requests that start with them skip their prefill.")
    warm.add_argument("model", help="a catalog name or a path to a .gguf file")
    warm.add_argument("files", nargs="+", metavar="FILE", help="text files to warm ('-' reads standard input)")
    warm.add_argument("--as", dest="role", choices=("system", "raw"), default="system",
                      help="system: each file as a chat's system message (default); raw: the text as is")
    warm.add_argument("--json", action="store_true", help="one JSON object per file on stdout")
    add_common_flags(warm, default=argparse.SUPPRESS)
    warm.add_argument("--ctx", type=positive_int, help="context length in tokens (chosen for host and model)")
    warm.add_argument("--kv-type", choices=("f16", "q8_0", "q4_0"), help="KV cache type (chosen for the host)")

    batch = commands.add_parser(
        "batch", help="answer an OpenAI batch input file (JSONL) on this machine",
        description="Answer every request of an OpenAI Batch API input file (a JSON object per line: custom_id, "
                    "method, url, body) as a server's /v1/batches would, with progress on stderr. The answers go to "
                    "FILE.output.jsonl, the errors to FILE.errors.jsonl. Stopped (Ctrl-C, a reboot), the same "
                    "command goes on where it stopped.")
    batch.add_argument("file", metavar="FILE.jsonl", help="the batch input file")
    batch.add_argument("--model", "-m", help="a catalog name or a path to a .gguf file (default: the config "
                                             f"file's model, else {catalog.DEFAULT_MODEL})")
    batch.add_argument("--output", "-o", metavar="FILE", help="where the answers go (FILE.output.jsonl)")
    batch.add_argument("--errors", metavar="FILE", help="where the errors go (FILE.errors.jsonl)")
    batch.add_argument("--endpoint", metavar="URL", help="the endpoint every line is for (default: the first line's "
                                                         "url): /v1/chat/completions, /v1/completions, ...")
    batch.add_argument("--json", action="store_true", help="the summary as a JSON object on stdout")
    add_common_flags(batch, default=argparse.SUPPRESS)
    batch.add_argument("--threads", type=positive_int, help="CPU threads (chosen for this host)")
    batch.add_argument("--ctx", type=positive_int, help="context length in tokens (chosen for host and model)")
    batch.add_argument("--kv-type", choices=("f16", "q8_0", "q4_0"), help="KV cache type (chosen for the host)")

    arca = commands.add_parser("arca", help="the Redis-protocol daemon: exact answer cache and shared corpus",
                               description="Serve ARCA, a Redis-protocol store (redis-cli and redis-py work with "
                                           "it) that Reame servers share: exact answers and the Palimpsest corpus.")
    arca.add_argument("--host", dest="arca_host", help="address to listen on (127.0.0.1)")
    arca.add_argument("--port", dest="arca_port", type=non_negative_int, help="TCP port (6420; 0 picks one)")
    arca.add_argument("--dir", dest="arca_dir", help="directory of the append-only file ($REAME_CACHE/arca)")
    arca.add_argument("--max-mb", dest="arca_max_mb", type=non_negative_float,
                      help="byte budget in MiB, least recently used keys evicted past it (256; 0 = no limit)")
    arca.add_argument("--requirepass", dest="arca_requirepass", help="password clients must AUTH with")
    arca.add_argument("--check-aof", action="store_true",
                      help="check the append-only file instead of serving: exit 0 when it loads whole, 1 when damaged")
    arca.add_argument("--fix", action="store_true",
                      help="with --check-aof: move a damaged file aside and keep the commands before the damage")
    add_common_flags(arca, default=argparse.SUPPRESS)
    commands.add_parser("list", help="the model catalog and what is on disk")
    pull = commands.add_parser("pull", help="download a catalog model without running it")
    pull.add_argument("model", help="a catalog name")
    pull.add_argument("--quantize", metavar="TYPE", choices=QUANT_TYPES,
                      help=f"also write a copy requantized to TYPE ({', '.join(QUANT_TYPES)}) beside it and print its "
                           "path (docs/models.md: which types batch faster here, and what they cost in quality)")
    return parser


def hints() -> str:
    """What bare `reame` prints, exiting 0 as the original did: the version and where to start."""
    return "\n".join([
        f"reame {__version__} (llama.cpp {LLAMA_COMMIT}): CPU-first LLM inference",
        f'  reame run {catalog.DEFAULT_MODEL} "prompt"   answer once; reame list shows the models',
        "  reame run MODEL                   chat",
        "  reame batch FILE.jsonl            answer an OpenAI batch file (FILE.output.jsonl)",
        "  reame --serve                     serve the API: ./config/reame.conf's model, or the first config",
        "                                    found (reame --print-config --serve says which)",
        "  reame --help                      every command and option"])


class VersionAction(argparse.Action):
    """--version, computed only when asked (it looks for the native library)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        print(version_text())
        parser.exit()


def version_text() -> str:
    """Version, pin, platform, which libllama build is in use, and which zstd this Python has."""
    import json
    import platform

    from reame import native
    from reame.cache import codec
    bundle = native.bundle_manifest()
    build = "libllama: not built (python build_zipapp.py --lib)"
    manifest: dict | None = None
    if bundle is not None:
        manifest, where = bundle["machines"].get(native.machine()), "bundled in this .pyz"
        if manifest is None:
            build = f"libllama: {native.unsupported_machine(bundle)}"
    else:
        try:
            located = native.locate()
            manifest = json.loads((located.lib_dir.parent / "manifest.json").read_text())
            where = str(located.lib_dir)
        except (ReameError, OSError, ValueError):
            pass
    if manifest is not None:
        build = f"libllama: {native.describe_build(manifest)} ({where})"
    return (f"reame {__version__} (llama.cpp {LLAMA_COMMIT}, {platform.system().lower()}-{platform.machine()}, "
            f"Python {platform.python_version()})\n{build}\n{codec.describe()}")
