"""A request's prompt as tokens, in the caller's thread (tokenizing is read-only): text, token ids, or a
fill-in-the-middle prompt. Anything the model cannot take is a RequestError before any work."""

from __future__ import annotations

from collections.abc import Sequence

from reame.engine.request import GenerationRequest
from reame.errors import RequestError
from reame.model.backend import Backend, Vocabulary


def prompt_tokens(backend: Vocabulary, request: GenerationRequest) -> list[int]:
    """Text tokenized with BOS (never twice), a fill-in-the-middle prompt built from the model's FIM tokens,
    or token ids checked against the vocabulary."""
    if request.suffix is not None:
        return fill_in_the_middle(backend, request.prompt, request.suffix)
    if isinstance(request.prompt, str):
        tokens = backend.tokenize(request.prompt, add_special=request.add_special, parse_special=True)
        # A chat template may already start with the BOS text: never feed BOS twice.
        if len(tokens) > 1 and tokens[0] == tokens[1] == backend.bos_token:
            del tokens[0]
        if not tokens:
            raise RequestError("the prompt tokenized to zero tokens", param="prompt")
        return tokens
    return checked_tokens(backend, request.prompt)


def checked_tokens(backend: Vocabulary, tokens: Sequence[int]) -> list[int]:
    for token in tokens:
        if not 0 <= token < backend.n_vocab:
            raise RequestError(f"token id {token} is outside the vocabulary (0..{backend.n_vocab - 1})",
                               param="prompt")
    return list(tokens)


def fill_in_the_middle(backend: Vocabulary, prefix: str | Sequence[int], suffix: str) -> list[int]:
    """Prefix-suffix-middle tokens, as code editors send `prompt` + `suffix`: the model writes the middle.
    User text is tokenized without parsing special tokens, so it cannot forge FIM markers."""
    fim = backend.fim_tokens()
    if fim is None:
        raise RequestError("this model has no fill-in-the-middle tokens; 'suffix' needs a code model such as "
                           "qwen2.5-coder", param="suffix", code="unsupported_parameter")
    pre, suf, mid = fim
    before = backend.tokenize(prefix, add_special=False, parse_special=False) if isinstance(prefix, str) \
        else checked_tokens(backend, prefix)
    bos = [backend.bos_token] if backend.add_bos and backend.bos_token >= 0 else []
    return bos + [pre] + before + [suf] + backend.tokenize(suffix, add_special=False, parse_special=False) + [mid]


# What llama-server puts before an extra chunk for a model without a file separator token.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject\n"  # llama-server's repository name in the repo-level pattern (not an input there)
FILE_NAME = "filename\n"  # and the name it gives the file being completed


def infill(backend: Backend, prefix: str, suffix: str, extra: Sequence[tuple[str, str]], middle: Sequence[int],
           n_predict: int, n_ctx: int) -> list[int]:
    """llama-server's /infill prompt, token for token (format_prompt_infill at the pin), so an editor plugin
    gets from Reame the completion it gets from llama-server: the extra chunks (`(filename, text)`) in the
    repo-level pattern when the model has its tokens (<repo>myproject, then <sep>name and text per chunk and
    <sep>filename), else each after a snippet separator, as many of their last tokens as `n_ctx` leaves past
    a batch and twice `n_predict`; then [BOS] <pre> the prefix's last three quarters of a batch and `middle`,
    <suf> the suffix's start (a quarter batch less `middle`), <mid>. User text is tokenized without parsing
    special tokens, so it cannot forge the markers; a RequestError for a model without FIM tokens."""
    fim = backend.fim_tokens()
    if fim is None:
        raise RequestError("this model has no fill-in-the-middle tokens; infill needs a code model such as "
                           "qwen2.5-coder", param="input_prefix", code="unsupported_parameter")
    pre, suf, mid = fim
    repo, separator = backend.fim_repo_tokens()

    def tokens(text: str) -> list[int]:
        return backend.tokenize(text, add_special=False, parse_special=False) if text else []
    context: list[int] = [repo] + tokens(REPO_NAME) if repo >= 0 else []
    for filename, text in extra:
        context += [separator] + tokens(filename + "\n") if separator >= 0 else tokens(SNIPPET_SEPARATOR)
        context += tokens(text)
    if separator >= 0:
        context += [separator] + tokens(FILE_NAME)
    batch = backend.n_batch
    before, after = tokens(prefix), tokens(suffix)
    before = before[len(before) - min(len(before), 3 * (batch // 4)):]
    after = after[:min(len(after), max(0, batch // 4 - (2 + len(middle))))]
    kept = min(max(0, n_ctx - batch - 2 * n_predict), len(context))
    bos = [backend.bos_token] if backend.add_bos and backend.bos_token >= 0 else []
    return context[len(context) - kept:] + bos + [pre] + before + list(middle) + [suf] + after + [mid]
