"""The benchmarks `python -m bench all` runs, in order, each with its full and its quick arguments.

The machine's ceiling comes first: every batching and speculation figure after it is to be read
beside what a step of B rows costs here. Quick runs use the small models and fewer repetitions;
they keep every comparison (Reame against llama.cpp's own tool, feature on against off).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    # The builds it runs on (bench/prerequisites.py): llama.cpp's tools, and the native libllama Reame
    # loads beside them so both sides run the same build.
    needs: tuple[str, ...] = ("tools", "native")

    def command(self, quick: bool) -> list[str]:
        """The arguments after `python`: the script and its options."""
        return [f"bench/{self.name}.py", *(self.quick if quick else self.full)]


SUITE = (
    Bench("ceiling", "The machine's ceiling: a decode step with 1–16 rows (llama-batched-bench)",
          ("--model", "qwen2.5-coder-1.5b", "--model", "qwen2.5-coder-0.5b", "--model", "smollm2-135m",
           "--model", "gemma3-270m"),
          ("--model", "qwen2.5-coder-1.5b", "--model", "smollm2-135m", "--tokens", "16")),
    Bench("decode", "Single-stream greedy decode vs llama-bench",
          ("--model", "smollm2-135m", "--model", "gemma3-270m", "--model", "qwen2.5-coder-0.5b",
           "--model", "qwen2.5-coder-1.5b", "--reps", "10"),
          ("--model", "smollm2-135m", "--model", "qwen2.5-coder-1.5b", "--reps", "2", "--tokens", "64")),
    Bench("portable", "Portable vs native libllama",
          ("--model", "smollm2-135m", "--model", "qwen2.5-coder-1.5b"),
          ("--model", "smollm2-135m", "--reps", "2", "--tokens", "64"), needs=("native", "portable")),
    Bench("sampling", "Sampling inside the decode graph vs on the CPU", (), ("--reps", "2", "--tokens", "64")),
    Bench("grammar_fallback", "A greedy draw the grammar refuses: the best allowed ranked token vs the whole vocab",
          (), ("--model", "smollm2-135m", "--texts", "3", "--tokens", "48"), needs=("native",)),
    Bench("server", "HTTP single stream vs llama-server",
          ("--model", "qwen2.5-coder-1.5b"), ("--reps", "2", "--tokens", "64")),
    Bench("concurrency", "Concurrent streams vs llama-server -np N",
          ("--clients", "1", "--clients", "2", "--clients", "4", "--clients", "8"),
          ("--clients", "1", "--clients", "4", "--reps", "1", "--tokens", "48")),
    Bench("quantization", "Which model files batch well: quantization types vs the original file",
          (), ("--model", "qwen2.5-coder-0.5b", "--types", "q4_0", "--tokens", "512", "--steps", "16")),
    Bench("prefix_cache", "Prefix cache: time to first token with a shared document vs llama-server",
          (), ("--model", "qwen2.5-coder-0.5b", "--prefix", "1000", "--reps", "4", "--restarts", "4",
           "--cold-pairs", "2")),
    Bench("kv_quality", "q8_0 against f16 KV", (),
          ("--model", "qwen2.5-coder-0.5b", "--tokens", "512", "--reps", "1")),
    Bench("speculative", "Speculative decoding vs llama-server's speculative modes", (),
          ("--tokens", "64", "--reps", "1")),
    Bench("palimpsest", "The Palimpsest: a template workload and a repeat after a restart", (),
          ("--products", "4", "--reps", "1", "--tokens", "96")),
    Bench("batch_numerics", "A row's logits by its batch's size: why a verified greedy answer can differ", (),
          ("--tokens", "96")),
    Bench("rowwise", "What a step computed row by row (exact greedy answers) costs vs ggml's batched kernels", (),
          ("--reps", "3"), needs=("native",)),
    Bench("tail_rows", "A prompt's tail after a cached prefix, by its rows, flash attention on and off", (),
          ("--reps", "1"), needs=("native",)),
    Bench("draft_ceiling", "The most copying drafts can buy greedy answers here, beside Reame and ngram-simple",
          ("--at", "64"), ("--model", "smollm2-135m", "--texts", "3", "--tokens", "48", "--reps", "1"),
          needs=("native",)),
    Bench("held_out", "Greedy means greedy: others' texts, speculation off, exact and not, a restart between",
          (), ("--model", "smollm2-135m", "--texts", "4", "--tokens", "64")),
    Bench("fleet", "The fleet: a document read on one node, asked of another through Redis and a Redis Cluster",
          (), ("--model", "smollm2-135m", "--tokens", "600", "--reps", "1", "--ctx", "2048"), needs=("native",)),
    Bench("documents", "The documents job: six documents asked about in turns, one node, a restart, a second node",
          ("--ram-cap-mb", "2048"), ("--questions", "2", "--clients", "1")),
    Bench("models", "Two models behind one server, asked in turn: Reame's pool vs llama-server's router",
          (), ("--reps", "2", "--rounds", "1")),
    Bench("semantic_cache", "The semantic answer cache: paraphrases answered and false hits per threshold", (),
          ("--model", "all-minilm-l6-v2"), needs=("native",)),
    Bench("workload", "The jobs users run, over two nights: triage, questions over a document, code completion",
          (), ("--concurrency", "1", "--tickets", "16", "--questions", "8", "--steps", "6")),
    Bench("batches", "A nightly triage job as an OpenAI batch vs llama-server, and a person's first token during it",
          (), ("--model", "smollm2-135m", "--lines", "40")),
    Bench("structured", "Structured output and Il Suggeritore vs llama-server's json_schema", (),
          ("--reps", "1")),
    Bench("conclave", "The Conclave: best-of-5 on an extraction exam", (), ("--exam", "8", "--timed", "1")),
    Bench("arca", "ARCA vs redis-server, and an exact-answer hit over HTTP", (),
          ("--model", "smollm2-135m", "--requests", "50000", "--reps", "1", "--hits", "50")),
    Bench("soak", "Soak: misbehaving clients against a few slots", (), ("--seconds", "15")),
    Bench("startup", "Start-up: a shell script's one-shot prompt and --serve until ready vs llama.cpp", (),
          ("--reps", "3"), needs=("tools", "pyz")),
    Bench("completion", "An editing session of llama.vim's /infill requests vs llama-server ± --cache-reuse 256",
          (), ("--model", "qwen2.5-coder-0.5b", "--lines", "4")),
    Bench("server_tests", "llama.cpp's own server tests: Reame vs llama-server, the same stand-in models", (), ()),
)
