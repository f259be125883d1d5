"""hydra/sweeper=private: dpmem's private hyperparameter selection (dpmem.engine.selection) as a Hydra sweeper
plugin. Hydra instantiates sweepers from this namespace package only; the search itself lives in dpmem."""

from hydra_plugins.dpmem_private_sweeper.private_sweeper import PrivateSweeper

__all__ = ["PrivateSweeper"]
