"""The inference engine: backends, requests and the thread that drives them."""

from reame.engine.request import (Completion, EmbeddingJob, FinishEvent, GenerationRequest, Handle, SamplingParams,
                                  SessionState, TokenEvent, Usage)
from reame.engine.scheduler import Engine

__all__ = ["Completion", "EmbeddingJob", "Engine", "FinishEvent", "GenerationRequest", "Handle", "SamplingParams",
           "SessionState", "TokenEvent", "Usage"]
