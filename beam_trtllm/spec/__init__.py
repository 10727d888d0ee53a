"""Speculative decoding's verification side: pure tensor functions the engine calls after a
verify forward (docs/SPECULATIVE.md "Verification", "Adaptive verification")."""

from .adaptive import (  # noqa: F401
    AcceptanceEstimator, CostCurve, DraftBudget, GraphBudget, observed_labels, profile_costs,
    profile_sizes, survival,
)
from .verify import (  # noqa: F401
    DRAFT_SALT, VERIFY_SALT, RequestSampling, SpecError, VerifyResult, draft_uniforms,
    proposal_probs, stream_seed, target_probs, uniform_source, verify,
)
