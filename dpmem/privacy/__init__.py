"""Privacy: accounting (dp-accounting), DP-SGD-RC's randomized-clipping envelope, and the samplers the accountant
assumes."""

from dpmem.privacy.accounting import UnreachableTarget, calibrate_sigma, composed_epsilon, epsilon_spent
from dpmem.privacy.rc_envelope import envelope_cdf, x_plus

__all__ = ["calibrate_sigma", "composed_epsilon", "envelope_cdf", "epsilon_spent", "x_plus", "UnreachableTarget"]
