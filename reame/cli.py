"""Command line: run, list, pull, and config mode (`reame --config FILE --prompt …`).

Answers go to stdout, logs and the stats line to stderr. Exit codes: 0 success,
2 usage or bad input, 1 runtime failure. A user error is one line, never a
traceback. A command imports what only it uses inside its function, so that a
one-shot prompt never pays for the HTTP server, ARCA or the grammar compilers, and
one answered from the exact answer cache not for libllama or the engine either
(tests/integration/test_startup.py lists what a one-shot run may import).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from reame import catalog, config, fetch, model_choice, oneshot
from reame.autoconfig import Choice
from reame.errors import ConfigError, FetchError, ModelFileError, ReameError, RequestError
from reame.cli_flags import build_parser, hints
from reame.model.backend import ModelSettings
from reame.oneshot import OneShot, Startup
from reame.settings import Settings, from_values

log = logging.getLogger("reame")

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
USER_ERRORS = (ConfigError, RequestError, FetchError, ModelFileError)
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("reame: %(message)s"))
    root = logging.getLogger("reame")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# --- settings ---------------------------------------------------------------------------

DEFAULT_MODEL_ORIGIN = "the catalog's default: no config names a model"  # --print-config's reason


def load_settings(args: argparse.Namespace, choice: config.ConfigChoice | None = None) -> Settings:
    """The settings of a command: `choice`'s config file (default: --config or $REAME_CONFIG), REAME_*,
    flags; in config mode (`choice` given) without model.path, the catalog's default model."""
    flags = {
        "generation.max_tokens": args.max_tokens, "generation.temperature": args.temp,
        "generation.seed": args.seed,
        "model.threads": getattr(args, "threads", None), "model.context_length": getattr(args, "ctx", None),
        "memory.kv_cache_type": getattr(args, "kv_type", None), "model.batch": getattr(args, "batch", None),
        "model.path": getattr(args, "model", None),
        "arca.host": getattr(args, "arca_host", None), "arca.port": getattr(args, "arca_port", None),
        "arca.dir": getattr(args, "arca_dir", None), "arca.max_mb": getattr(args, "arca_max_mb", None),
        "arca.requirepass": getattr(args, "arca_requirepass", None),
        "speculative.draft_model": getattr(args, "draft_model", None),
        "server.host": args.host, "server.port": args.port,
        "server.api_key": ",".join(args.api_key) if args.api_key else None, "server.parallel": args.parallel,
    }
    values = config.load((choice or config.choose_config(args.config, search=False)).path, flags=flags)
    if choice is not None and not values["model.path"].value:
        values["model.path"] = config.Value(catalog.DEFAULT_MODEL, DEFAULT_MODEL_ORIGIN)
    return from_values(values)


def print_config(settings: Settings, chosen: model_choice.Plan) -> None:
    for name, value, origin in settings.origins:
        if name not in chosen:
            print(f"{name} = {value!s}  # {origin}")
    for name, choice in chosen.items():
        print(f"{name} = {choice.value!s}  # {choice.why}")


# --- commands -----------------------------------------------------------------------------

def read_prompt(prompt: str | None) -> str | None:
    """The prompt the command line gives (None: none, "-": standard input); a ConfigError when it is empty."""
    if prompt == "-":
        return read_stdin_prompt()
    if prompt is not None and not prompt.strip():
        raise ConfigError("the prompt is empty")
    return prompt


def read_stdin_prompt() -> str:
    prompt = sys.stdin.read()
    if not prompt.strip():
        raise ConfigError("the prompt read from standard input is empty")
    return prompt


def command_run(args: argparse.Namespace, settings: Settings, startup: Startup) -> int:
    prompt = read_prompt(args.prompt)
    grammar = answer_grammar(args)
    if grammar is not None:
        settings = dataclasses.replace(settings, generation=dataclasses.replace(settings.generation, grammar=grammar))
    path, entry = model_choice.resolve_model(settings.model.path, model_choice.progress_stream())
    chosen = model_choice.plan(settings, path, entry)
    startup.mark("model found and planned")
    best_of = getattr(args, "best_of", None) or 1
    one_shot = OneShot(prompt, args.system, args.raw, best_of, args.quiet) if prompt is not None else None
    if args.print_config:
        if one_shot is not None and oneshot.sized(settings, one_shot):
            chosen["model.context_length"] = one_shot_context(one_shot, settings, path, chosen)
        print_config(settings, chosen)
        return EXIT_OK
    if args.serve:
        if best_of > 1:
            raise ConfigError("--best-of elects one answer here; API clients ask for it per request (best_of)")
        from reame.node import serve_model
        return serve_model(settings, path, entry, chosen)
    model = model_choice.model_settings(path, settings, chosen, n_seq=best_of)
    if one_shot is not None:
        return answer_one_shot(one_shot, settings, model, startup)
    if best_of > 1:
        raise ConfigError("--best-of elects one answer: give a prompt")
    from reame import assembly
    from reame.chat import Conversation, line_reader, repl
    from reame.model.llama import LlamaBackend
    log.info("loading %s (%s threads, context %s, %s KV)", path.name, model.n_threads, model.n_ctx, model.kv_type)
    with assembly.new_engine(LlamaBackend(model), settings) as engine:
        conversation = Conversation(engine, settings.generation, system=args.system)
        return repl(conversation, line_reader(), title=entry.name if entry else path.name)


def answer_one_shot(one_shot: OneShot, settings: Settings, model: ModelSettings, startup: Startup) -> int:
    """`one_shot` answered by libllama's model and engine, through the exact answer cache when it is on."""
    from reame.answers import answer_cache
    answers = answer_cache(settings, model.kv_fingerprint(), ram=False)
    status = oneshot.answer(one_shot, settings, model, startup, answers,
                            oneshot.libllama(settings, one_shot.raw))
    log.debug("%s", startup.line())
    return status


def one_shot_context(one_shot: OneShot, settings: Settings, path: Path, chosen: model_choice.Plan) -> Choice:
    """The context `one_shot` gets, for --print-config: its prompt is tokenized (the vocabulary only)."""
    from reame.engine import GenerationRequest
    from reame.engine.prompt import prompt_tokens
    from reame.model.loaded_model import LoadedModel
    with LoadedModel(model_choice.model_settings(path, settings, chosen)) as loaded:
        prompt = one_shot.prompt
        if loaded.has_chat_template and not one_shot.raw:
            prompt = loaded.apply_chat_template(
                ([{"role": "system", "content": one_shot.system}] if one_shot.system else []) +
                [{"role": "user", "content": prompt}])
        tokens = prompt_tokens(loaded, GenerationRequest(prompt, settings.generation))
    return oneshot.context_choice(chosen["model.context_length"], len(tokens), settings.generation.max_tokens)


def answer_grammar(args: argparse.Namespace) -> str | None:
    """The GBNF of --json-schema or --grammar (read and checked before the model loads), or None."""
    if args.json_schema and args.grammar:
        raise ConfigError("give --json-schema or --grammar, not both")
    if not args.json_schema and not args.grammar:
        return None
    from reame.structured.grammar import GrammarError
    from reame.structured.json_schema import schema_to_gbnf
    from reame.structured.requested import checked
    try:
        if args.json_schema:
            try:
                schema = json.loads(read_text_file(args.json_schema))
            except ValueError as error:
                raise ConfigError(f"{args.json_schema} is not JSON: {error}") from None
            return checked(schema_to_gbnf(schema, param=args.json_schema))
        return checked(read_text_file(args.grammar))
    except GrammarError as error:
        raise ConfigError(str(error)) from None


def command_config_mode(args: argparse.Namespace, settings: Settings, choice: config.ConfigChoice) -> int:
    """The original's config mode: `--serve`, `--prompt TEXT` (raw, no chat template) or `--print-config`
    with the config file `choice`; without a config file, the catalog's default model, as `reame run`
    would serve it."""
    if args.prompt is None and not args.serve and not args.print_config:
        log.info("nothing to do: pass --prompt TEXT or --serve")
        return EXIT_OK
    log.info("config: %s", choice.why)
    if ("model.path", catalog.DEFAULT_MODEL, DEFAULT_MODEL_ORIGIN) in settings.origins:
        log.info("no config names a model: the catalog's default, %s, as `reame run %s%s` would",
                 catalog.DEFAULT_MODEL, catalog.DEFAULT_MODEL, " --serve" if args.serve else "")
    path, entry = model_choice.resolve_model(settings.model.path, model_choice.progress_stream())
    chosen = model_choice.plan(settings, path, entry)
    if args.print_config:
        print(f"# config file: {choice.path or 'none'} ({choice.why})")
        print_config(settings, chosen)
        return EXIT_OK
    if args.serve:
        from reame.node import serve_model
        return serve_model(settings, path, entry, chosen)
    model = model_choice.model_settings(path, settings, chosen, n_seq=args.best_of or 1)
    return answer_one_shot(OneShot(args.prompt, raw=True, best_of=args.best_of or 1, quiet=args.quiet), settings, model,
                           Startup(time.perf_counter()))


def command_warm(args: argparse.Namespace, settings: Settings) -> int:
    """Prefill each file into the prefix cache; one line (or JSON object) per file on stdout."""
    from reame import assembly
    from reame.engine import GenerationRequest
    from reame.model.llama import LlamaBackend
    if not settings.cache.enabled:
        raise ConfigError("the prefix cache is off (cache.enabled = false): warming would keep nothing")
    texts = [(name, read_stdin_prompt() if name == "-" else read_text_file(name)) for name in args.files]
    path, entry = model_choice.resolve_model(settings.model.path, model_choice.progress_stream())
    chosen = model_choice.plan(settings, path, entry)
    with assembly.new_engine(LlamaBackend(model_choice.model_settings(path, settings, chosen)), settings,
                             speculate=False) as engine:
        for name, text in texts:
            prompt = text
            if args.role == "system" and engine.backend.has_chat_template:
                prompt = engine.backend.apply_chat_template([{"role": "system", "content": text}],
                                                            add_assistant=False)
            request = GenerationRequest(prompt, warm=True)
            usage = engine.generate(request).finish.usage
            # Published to the fleet's store (arca.remote) before the process exits: the engine's close waits.
            shared = engine.cache is not None and engine.cache.share(engine.prompt_tokens(request))
            if args.json:
                print(json.dumps({"file": name, "tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                                  "seconds": round(usage.prompt_seconds, 3), "shared": shared}))
            else:
                print(f"{name}: {usage.prompt_tokens} tokens warmed in {usage.prompt_seconds:.2f} s "
                      f"({usage.cached_tokens} were already cached)" + (", shared with the fleet" if shared else ""))
    return EXIT_OK


def command_batch(args: argparse.Namespace, settings: Settings) -> int:
    """An OpenAI batch input file answered by the server's own batch runner; a summary on stdout."""
    from reame.batch_file import Progress, batch_input, result_paths, run_batch_file
    from reame.node import node_of
    if getattr(args, "best_of", None):
        raise ConfigError("--best-of: a batch's line asks for the Conclave in its body (a chat's "
                          "\"reame\": {\"best_of\": N}, a completion's best_of)")
    destinations = result_paths(Path(args.file), args.output, args.errors)
    source = batch_input(Path(args.file), settings.server.batch_storage_bytes, args.endpoint)
    path, entry = model_choice.resolve_model(settings.model.path, model_choice.progress_stream())
    node = node_of(settings, path, entry, model_choice.plan(settings, path, entry))
    progress = None if args.quiet else Progress()
    if progress is not None and progress.live:  # a log line would land in the middle of the line redrawn in place
        logging.getLogger("reame.batches").setLevel(logging.WARNING)
    try:
        outcome = run_batch_file(node.models, node.settings, source, destinations,
                                 progress if progress is not None else lambda _batch: None)
    except KeyboardInterrupt:
        print("reame: interrupted: the same command goes on where this one stopped", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        node.models.close()
        node.close_shared()
    batch, counts = outcome.batch, outcome.batch["request_counts"]
    if args.json:
        print(json.dumps({"batch": batch["id"], "status": batch["status"], **counts,
                          "output": str(outcome.output) if outcome.output else None,
                          "errors": str(outcome.errors) if outcome.errors else None,
                          "seconds": round(outcome.seconds, 3)}))
    else:
        files = [f"{path}: {count} {what}{'s' * (count != 1)}" for path, count, what in
                 ((outcome.output, counts["completed"], "answer"), (outcome.errors, counts["failed"], "error")) if path]
        print(f"{batch['id']} {batch['status']} in {outcome.seconds:.1f} s: "
              + (" · ".join(files) or "nothing written"))
    return EXIT_OK if outcome.whole else EXIT_RUNTIME


def read_text_file(name: str) -> str:
    try:
        text = Path(name).read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read {name}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name} is not UTF-8 text") from None
    if not text.strip():
        raise ConfigError(f"{name} is empty")
    return text


def command_arca(settings: Settings, check_aof: bool = False, fix: bool = False) -> int:
    from reame.arca import server as arca_server
    from reame.arca.aof import AOF_NAME, check_log
    from reame.arca.types import ArcaSettings
    options = settings.arca
    if fix and not check_aof:
        raise ConfigError("--fix goes with --check-aof")
    if check_aof:
        sound, report = check_log(options.directory / AOF_NAME, fix)
        print(report)
        return EXIT_OK if sound else EXIT_RUNTIME
    if options.host not in ("127.0.0.1", "localhost", "::1") and not options.requirepass:
        log.warning("ARCA listens on %s without a password: anyone who can reach it can read and change it "
                    "(set --requirepass)", options.host)
    return arca_server.run(ArcaSettings(options.host, options.port, options.directory, options.max_bytes,
                                        options.requirepass, options.max_clients, options.timeout_s,
                                        options.max_query_bytes))


def command_list() -> int:
    directory = fetch.models_dir()
    print(f"Catalog (reame run NAME); models live in {directory}\n")
    for entry in catalog.CATALOG:
        path = directory / entry.filename
        if not path.exists():
            state = "not downloaded"
        else:
            state = f"on disk, {path.stat().st_size / 2**20:.0f} MiB, " + \
                ("verified" if fetch.is_verified(path, entry) else "NOT verified (checksum mismatch)")
        checksum = fetch.checksum_state(path, entry)
        print(f"  {entry.name:<20} {entry.description}")
        print(f"  {'':<20} use: {entry.use} · license: {entry.license} · sha256 {checksum} · {state}")
    others = sorted(p for p in directory.glob("*.gguf") if p.name not in {e.filename for e in catalog.CATALOG}) \
        if directory.is_dir() else []
    if others:
        print("\nOther models on disk:")
        for path in others:
            print(f"  {path}")
    print("\nOr: reame run /path/to/your-model.gguf")
    return EXIT_OK


def command_pull(args: argparse.Namespace) -> int:
    entry = catalog.resolve(args.model)
    if entry is None:
        raise ConfigError(f"unknown model '{args.model}'; catalog names: {', '.join(catalog.suggestions(args.model))}")
    path = fetch.ensure_model(entry, progress=model_choice.progress_stream())
    if args.quantize:
        log.info("requantizing %s to %s…", path.name, args.quantize)
        from reame.model.backend import usable_cores
        from reame.quantize import requantize
        path = requantize(path, args.quantize, usable_cores())
    print(path)
    return EXIT_OK


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, with `run`'s prompt allowed after its options (`run MODEL --temp 0 -`): argparse
    fills an optional positional at its first chance, so a prompt after the options is left over."""
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "run" and args.prompt is None and len(rest) == 1 and \
            (rest[0] == "-" or not rest[0].startswith("-")):
        args.prompt, rest = rest[0], []
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: Sequence[str] | None = None, began: float | None = None) -> int:
    """`began`: when the process started importing Reame (reame/__main__.py), for the startup line."""
    startup = Startup(time.perf_counter() if began is None else began)
    startup.mark("imports")
    parser = build_parser()
    args = parse(parser, argv)
    quiet = getattr(args, "quiet", False)
    configure_logging(logging.WARNING if quiet else logging.INFO)
    try:
        if args.command == "list":
            return command_list()
        if args.command == "pull":
            return command_pull(args)
        config_mode = args.command is None and (args.serve or args.prompt is not None or args.print_config
                                                 or args.config)
        if args.command not in ("run", "warm", "arca", "batch") and not config_mode:
            print(hints())
            return EXIT_OK
        # config mode and batches read the config file a server would (and want a model without one)
        choice = config.choose_config(args.config, search=True) if config_mode or args.command == "batch" else None
        settings = load_settings(args, choice)
        if not quiet:
            configure_logging(LOG_LEVELS[settings.log_level])
        if args.command == "run":
            return command_run(args, settings, startup)
        if args.command == "warm":
            return command_warm(args, settings)
        if args.command == "arca":
            return command_arca(settings, args.check_aof, args.fix)
        if args.command == "batch":
            return command_batch(args, settings)
        assert choice is not None  # config mode: the command line names no subcommand
        return command_config_mode(args, settings, choice)
    except USER_ERRORS as error:
        print(f"reame: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ReameError as error:
        print(f"reame: error: {error}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("reame: interrupted", file=sys.stderr)
        return EXIT_RUNTIME
