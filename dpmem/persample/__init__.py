"""Per-sample gradients: hooks capture layer inputs and output gradients; one rule per layer type."""

from dpmem.persample.hooks import PerSampleGradients, clip_factors, per_sample_norms, weighted_sum
from dpmem.persample.registry import register, rule_for

__all__ = ["PerSampleGradients", "per_sample_norms", "clip_factors", "weighted_sum", "register", "rule_for"]
