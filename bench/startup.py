#!/usr/bin/env python3
"""Start-up: a shell script's one-shot prompt and a server's time to ready, dist/reame.pyz vs llama.cpp.

    python bench/startup.py                         # SmolLM2-135M, autoconfig's threads, 5 warm runs each
    python bench/startup.py --model qwen2.5-coder-0.5b --reps 8

A .pyz is built from this tree (the cached portable libraries) and run with
`python -I` of the base interpreter (not this venv's: a user's bare Python),
from a fresh cache directory (the models linked in): its first run extracts
and compiles, the later ones are warm. Each warm one-shot is timed beside
llama-completion (built with the bench tools) doing the same work, in ABAB
order: `run MODEL "Hi" --max-tokens 1 -q`, which renders the model's chat
template, against llama-completion given that rendered prompt; and a raw
prompt (`--raw`) against `llama-completion -no-cnv -p Hi -n 1`. Reame's
one-shots compute their answer every time (cache.answers off, as for a prompt
never seen before); llama-completion runs as a user types it, with its
default context, and once more with the context Reame's one-shot gets
(`--print-config`), which is the same work. A warm one-shot restores the
chat template's opening from the template head the first run wrote
(reame/cache/heads.py); the row with the KV cache off prefills it, as the
first one-shot of a model on a machine does. "A repeated prompt" is Reame's
exact answer cache (the answer computed once before the runs) against
llama-completion computing it again. `--serve` is timed from the command to
the first 200 of /health, beside llama-server, both with the serving context.
The per-phase breakdown is Reame's own startup line
(`REAME_LOGGING_LEVEL=debug`) of a computed one-shot, with the interpreter's
start before it and the exit after it told apart by the monotonic clock both
processes share.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, bench_parser, llama_tool, machine, model_path, print_table, summary
from server import wait_ready

from reame.native import LLAMA_COMMIT

STARTUP_LINE = re.compile(r"startup: (.*) \(began at ([\d.]+)\)")


def build_pyz(directory: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    import build_zipapp
    output = directory / "reame.pyz"
    if build_zipapp.main(["--output", str(output)]) != 0:
        sys.exit("building the .pyz failed")
    return output


def fresh_cache(directory: Path) -> Path:
    """A cache of its own (so the .pyz's first run is a first run) sharing the user's models."""
    from reame.native import cache_root
    cache = directory / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models")
    return cache


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """When one run started and ended (perf_counter), and its stderr; a failed run stops the benchmark."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    ended = time.perf_counter()
    if result.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} … failed ({result.returncode}): {result.stderr[-800:]}")
    return started, ended, result.stderr


def wall(command: list[str], env: dict[str, str] | None = None) -> float:
    started, ended, _ = timed(command, env)
    return ended - started


def ready_after(command: list[str], port: int, env: dict[str, str] | None = None) -> float:
    """Seconds from starting a server to its first 200 on /health (asked every 10 ms)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(port, process, timeout_s=300, poll_s=0.01)
        return time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=60)


def chosen(reame: list[str], model: str, env: dict[str, str], *prompt: str) -> tuple[int, int]:
    """The threads and context Reame's autoconfig gives `model` here: a server's, or with `prompt` (the
    command's words after the model) a one-shot's."""
    printed = subprocess.run([*reame, "run", model, *prompt, "--print-config"], capture_output=True, text=True,
                             env=env, timeout=300).stdout
    value = lambda key: int(re.search(rf"^{re.escape(key)} = (\d+)", printed, re.M).group(1))  # noqa: E731
    return value("model.threads"), value("model.context_length")


def rendered_prompt(path: Path, prompt: str) -> str:
    """The text Reame's one-shot run feeds the model for `prompt`: the model's chat template applied."""
    from reame.model.backend import ModelSettings
    from reame.model.llama import LlamaBackend
    backend = LlamaBackend(ModelSettings(str(path), n_ctx=512, n_threads=1))
    try:
        return backend.apply_chat_template([{"role": "user", "content": prompt}], add_assistant=True)
    finally:
        backend.close()


def phases(stderr: str, spawned: float, exited: float) -> list[tuple[str, float]]:
    """Reame's startup line as (phase, seconds), between the interpreter's start (from `spawned`, this
    process's perf_counter when it started the run: the same monotonic clock) and the exit (to `exited`)."""
    found = STARTUP_LINE.search(stderr)
    if found is None:
        sys.exit("no startup line in Reame's log (REAME_LOGGING_LEVEL=debug)")
    measured = [(name.strip(), float(ms) / 1000) for name, ms in re.findall(r"([^,(]+?) (\d+) ms", found.group(1))]
    began = float(found.group(2))
    ended = began + sum(seconds for _, seconds in measured)
    return [("interpreter start and the .pyz's bootstrap", began - spawned), *measured,
            ("exit (the engine, the model and the interpreter shut down)", exited - ended)]


def main() -> int:
    parser = bench_parser(__doc__, "smollm2-135m", 1, 5, tokens_help="tokens to generate")
    parser.set_defaults(threads=0)  # autoconfig's, as in the one-shot command users type
    args = parser.parse_args()
    path = model_path(args.model)
    completion, server = llama_tool("llama-completion"), llama_tool("llama-server")
    library_path = {**os.environ, "LD_LIBRARY_PATH": str(completion.parent)}
    work = Path(tempfile.mkdtemp(prefix="reame-startup-"))
    try:
        pyz = build_pyz(work)
        env = {"HOME": str(work), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "REAME_CACHE": str(fresh_cache(work))}
        computing = {**env, "REAME_CACHE_ANSWERS": "0"}
        reame = [getattr(sys, "_base_executable", sys.executable), "-I", str(pyz)]
        asked = ["Hi", "--max-tokens", str(args.tokens)]
        first_run = wall([*reame, "run", args.model, *asked, "-q"], env)  # and the answer kept
        threads, context = chosen(reame, args.model, env)
        _, one_shot_context = chosen(reame, args.model, env, *asked)
        threads = args.threads or threads
        one_shot = [*reame, "run", args.model, *asked, "-q", *(["--threads", str(threads)] if args.threads else [])]
        templated = rendered_prompt(path, "Hi")
        peer = [str(completion), "-m", str(path), "-t", str(threads), "-n", str(args.tokens), "-no-cnv", "--temp", "0"]
        sized_peer = [*peer, "-c", str(one_shot_context)]
        runs = {  # name: (Reame's command, its environment, llama.cpp's command)
            "one-shot, the model's chat template": (one_shot, computing, [*peer, "-p", templated]),
            "one-shot, the chat template, no template head (KV cache off: as a model's first one-shot)":
                (one_shot, {**computing, "REAME_CACHE_ENABLED": "0"}, [*peer, "-p", templated]),
            "one-shot, the chat template; llama.cpp in Reame's one-shot context":
                (one_shot, computing, [*sized_peer, "-p", templated]),
            "one-shot, raw prompt": ([*one_shot, "--raw"], computing, [*peer, "-p", "Hi"]),
            "a repeated prompt (Reame: its exact answer cache)": (one_shot, env, [*peer, "-p", templated]),
        }
        walls: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
        for _ in range(args.reps):
            for name, (ours, our_env, theirs) in runs.items():
                walls[name][0].append(wall(ours, our_env))
                walls[name][1].append(wall(theirs, library_path))
        serve_walls: tuple[list[float], list[float]] = ([], [])
        for rep in range(max(2, args.reps // 2)):
            port = 18700 + rep
            serve_walls[0].append(ready_after([*reame, "run", args.model, "--serve", "--port", str(port), "--threads",
                                               str(threads), "--ctx", str(context), "-q"], port, env))
            serve_walls[1].append(ready_after([str(server), "-m", str(path), "-t", str(threads), "-c", str(context),
                                               "--port", str(port), "--host", "127.0.0.1"], port, library_path))
        spawned, exited, log = timed([c for c in one_shot if c != "-q"], {**computing, "REAME_LOGGING_LEVEL": "debug"})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"## Start-up: {args.model}, {threads} threads; a one-shot's context {one_shot_context}, a server's "
          f"{context} (llama.cpp {LLAMA_COMMIT}; {machine()}; Python {sys.version.split()[0]})\n")
    rows = [["one-shot, first run of the .pyz (extract + compile)", f"{first_run:.2f}", "", ""]]
    for name, (ours, theirs) in [*walls.items(), ("--serve until /health is 200", serve_walls)]:
        ratio = statistics.median(ours) / statistics.median(theirs)
        rows.append([name, summary(ours, 2), summary(theirs, 2), f"{ratio:.2f}"])
    print_table(["run", "Reame s (median, min–max)", "llama.cpp s", "Reame / llama.cpp"], rows)
    print(f"\nllama.cpp: llama-completion -no-cnv for one-shots (its default context unless said), llama-server "
          f"for --serve; {args.reps} warm runs each, alternating.\n")
    print_table(["phase of one warm one-shot (chat template, computed)", "ms"],
                [*[[name, f"{seconds * 1000:.0f}"] for name, seconds in phases(log, spawned, exited)],
                 ["wall", f"{(exited - spawned) * 1000:.0f}"]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
