"""dpmem: memory-efficient differentially private training of large neural networks."""

__version__ = "0.1.0"
