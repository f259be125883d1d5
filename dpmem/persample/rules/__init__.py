"""Per-sample gradient rules, one file per layer type; importing this package registers them all."""

from dpmem.persample.rules import (conv1d, conv2d, embedding, layernorm, linear, multihead_attention,  # noqa: F401
                                    recurrent)
