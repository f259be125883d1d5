"""What a spectrum folder holds that no noise covers: it is an analysis, not a private result."""

from __future__ import annotations

import math

# by mode (and for a re-analysis of recorded gradients): why the folder is not private whatever ε its training spent
NOT_PRIVATE = {
    "layer": "spectrum.json holds singular values of the training data's batch gradients measured outside the run's "
             "noise (unclipped, at sigma 0, or with noise drawn from spectrum.seed, which config.yaml holds)",
    "trajectory": "gradients/ holds every step's clipped, un-noised mean gradient of the training data, and "
                  "subspace.pt the directions computed from them",
    "reanalysis": "subspace.pt and spectrum.json are computed from recorded clipped, un-noised gradients of a run's "
                  "training data",
}


def mark_not_private(run, mode: str) -> None:
    """A spectrum run's summary and privacy.jsonl as what its folder is: an analysis, not private (ε inf, the
    reason beside it), from its first line; `dpmem report` keeps it out of private results."""
    why = NOT_PRIVATE[mode]
    run.mechanism.mark_leak(f"a spectrum folder: {why}")
    run.summary.update(private=False, epsilon_spent=math.inf, analysis="spectrum", not_private_because=why)
