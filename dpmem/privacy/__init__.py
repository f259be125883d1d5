"""Privacy: accounting (dp-accounting) and the samplers the accountant assumes."""

from dpmem.privacy.accounting import UnreachableTarget, calibrate_sigma, epsilon_spent

__all__ = ["calibrate_sigma", "epsilon_spent", "UnreachableTarget"]
