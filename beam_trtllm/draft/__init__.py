"""The DFlash2 block drafter of a Beam target (`DFlash2BeamDraftModel`, as vLLM 0.33 and SGLang
0.5.23 load it): config, weights, forward over its own paged K/V, and its training
(docs/SPECULATIVE.md "Drafter")."""

from .config import DraftConfig, DraftError
from .kv import DraftKV
from .model import DFlash2Drafter, DraftOutput
from .weights import expected_tensors, init_draft_weights, load_draft_weights, save_draft

__all__ = ["DFlash2Drafter", "DraftConfig", "DraftError", "DraftKV", "DraftOutput",
           "expected_tensors", "init_draft_weights", "load_draft_weights", "save_draft"]
