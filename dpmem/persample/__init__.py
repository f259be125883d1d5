"""Per-sample gradients: taps (`dpmem.persample.taps`, values returned to the step) capture layer inputs and output
gradients, or reduce them inside the backward pass as it leaves each layer; one rule per layer type; the caller's
reducer per parameter says what is kept of them."""

from dpmem.persample import reducers
from dpmem.persample.clipping import clip_factors, per_sample_norms, weighted_sum
from dpmem.persample.factored import weighted_sum_of
from dpmem.persample.projection import Projection
from dpmem.persample.registry import factored_weights, projectable_weights, register, rule_for
from dpmem.persample.taps import Taps

__all__ = ["Taps", "Projection", "reducers", "per_sample_norms", "clip_factors", "weighted_sum",
           "weighted_sum_of", "register", "rule_for", "projectable_weights", "factored_weights"]
