"""The inference engine: backends, requests and the thread that drives them."""

from reame.engine.embeddings import EmbeddingJob
from reame.engine.request import (Completion, FinishEvent, GenerationRequest, Handle, ProgressEvent, SamplingParams,
                                  Session, SessionState, TokenEvent, Usage)
from reame.engine.scheduler import Engine, EngineStatus

__all__ = ["Completion", "EmbeddingJob", "Engine", "EngineStatus", "FinishEvent", "GenerationRequest", "Handle",
           "ProgressEvent", "SamplingParams", "Session", "SessionState", "TokenEvent", "Usage"]
