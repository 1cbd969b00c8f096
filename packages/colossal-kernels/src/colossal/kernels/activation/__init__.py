"""Fused activations: one kernel per direction where a model composes several.

GPT-2's ``gelu_new`` (transformers' ``NewGELUActivation``) computes the tanh approximation of
GELU as seven elementwise operations, each a pass over the MLP's widest activation in forward
and more in backward: on a 2-core CPU about a third of a small GPT-2's step.
:class:`FusedGELUTanh` computes the same function with ATen's single tanh-approximate GELU
kernel (``F.gelu(x, approximate="tanh")``) and its single backward kernel.
"""

from colossal.kernels.activation.gelu import FusedGELUTanh, gelu_tanh, replace_activations

__all__ = ["FusedGELUTanh", "gelu_tanh", "replace_activations"]
