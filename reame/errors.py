"""One exception type per layer, each carrying a message a user can act on.

The edges (CLI, HTTP, RESP) turn these into exit codes, status codes and error
replies; nothing below them prints or exits.
"""

import os


class ReameError(Exception):
    """Base of every error Reame reports to a user."""


class ConfigError(ReameError):
    """A setting, flag or config file value is wrong."""


class ModelError(ReameError):
    """The native library or the model cannot be loaded or used."""


class RequestError(ReameError):
    """A generation request is invalid (bad parameter, too long for the context). `code` is the
    machine-readable reason an API answer carries (OpenAI's codes where one exists)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextExceeded(RequestError):
    """A prompt as long as the context a request may fill, or longer: OpenAI's code, and llama-server's counts
    (`n_prompt_tokens`, `n_ctx`) which its clients read."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(f"This model's maximum context length is {n_ctx} tokens. However, your prompt resulted in "
                         f"{n_prompt_tokens} tokens. Please reduce the length of the prompt.",
                         param="prompt", code="context_length_exceeded")
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class CacheError(ReameError):
    """A cache file or directory cannot be used."""


class FetchError(ReameError):
    """A model could not be downloaded or verified."""


class ModelFileError(ModelError):
    """The model path does not name a readable GGUF file (bad input, not a runtime failure)."""


class OverloadedError(ReameError):
    """The server is full (its waiting queue is at its limit): retry later."""


class EngineUnavailable(ReameError):
    """The engine is shutting down or has failed: nothing new can run (an HTTP 503)."""


class ListenError(ConfigError):
    """The address to serve on cannot be bound (taken by another server, not ours to use)."""

    def __init__(self, host: str, port: int, error: OSError) -> None:
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        super().__init__(f"cannot listen on {host}:{port}: {reason} (another server there? choose another "
                         "port, or 0 for a free one)")
