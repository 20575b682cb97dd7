"""Speculative decoding: draft sources, exact verification, and the controller that decides when it pays."""

from reame.speculative.controller import CostModel, DraftController, SpeculationStats
from reame.speculative.lookup import PromptLookup
from reame.speculative.source import Drafter, DraftSource
from reame.speculative.speculation import Drafting, Speculation

__all__ = ["CostModel", "DraftController", "DraftSource", "Drafter", "Drafting", "PromptLookup", "Speculation",
           "SpeculationStats"]
