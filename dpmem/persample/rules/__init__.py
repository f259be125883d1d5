"""Per-sample gradient rules, one file per layer type; importing this package registers them all."""

from dpmem.persample.rules import (conv1d, conv2d, deberta_attention, embedding, layernorm, linear,  # noqa: F401
                                    multihead_attention, recurrent)
