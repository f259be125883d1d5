"""Per-sample gradients: taps (values returned; one-pass clipping) or callbacks (two-pass clipping, activation
checkpointing, FSDP) capture layer inputs and output gradients; one rule per layer type; the caller's reducer per
parameter says what is kept of them."""

from dpmem.persample import reducers
from dpmem.persample.clipping import clip_factors, per_sample_norms, weighted_sum
from dpmem.persample.factored import weighted_sum_of
from dpmem.persample.hooks import PerSampleGradients
from dpmem.persample.projection import Projection
from dpmem.persample.registry import factored_weights, projectable_weights, register, rule_for

__all__ = ["PerSampleGradients", "Projection", "reducers", "per_sample_norms", "clip_factors", "weighted_sum",
           "weighted_sum_of", "register", "rule_for", "projectable_weights", "factored_weights"]
