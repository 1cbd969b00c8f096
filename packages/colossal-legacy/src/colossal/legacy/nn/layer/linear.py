"""``Linear``, ``Classifier`` and ``VocabParallelClassifier`` of ``colossalai.nn``, by mode.

==============  ===================  ==========================  ===============================
mode            ``Linear``           ``Classifier``              ``VocabParallelClassifier``
==============  ===================  ==========================  ===============================
None, sequence  ``nn.Linear``        ``nn.Linear``               ``nn.Linear``
``'1d'``        column, then row     ``Linear1D_Row``            ``VocabParallelLMHead1D``
``'2d'``        ``Linear2D``         ``Classifier2D``            ``VocabParallelClassifier2D``
``'2.5d'``      ``Linear2p5D``       ``Classifier2p5D``          ``VocabParallelClassifier2p5D``
``'3d'``        ``Linear3D``         ``Classifier3D``            ``VocabParallelClassifier3D``
==============  ===================  ==========================  ===============================

In ``'1d'`` a ``Linear`` is column-parallel (output features split, ``Linear1D_Col``) when
its input is whole and row-parallel (``Linear1D_Row``, one all-reduce) when the previous
layer left it split (``gpc.layer_env.parallel_input``), as ColossalAI decided: a column
Linear sets the flag, a row Linear or a classifier clears it, so the seed page's MLP is
column then row. ``gather_output=True`` makes a column Linear gather its output (the flag
stays clear). In ``'3d'`` each ``Linear`` and ``VocabParallelClassifier`` exchanges the
cube's input and output axes for the layers after it (``gpc.layer_env.swapped_3d``).

The 2D/2.5D/3D layers take this rank's block of the activation (the seed pages' input
partitioning); modules hold parts of the whole weights in torch's layout (``[out, in]``:
the pages print ColossalAI's ``[in, out]``, i.e. ``weight.t().shape``), and ``state_dict``
gives the whole tensors (:func:`~._dispatch.whole_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from colossal.core import shard_spec
from colossal.legacy.nn.layer._dispatch import (
    ModeDispatch,
    agreed,
    grid_dims,
    layer_env,
    tensor_mode,
    tp_group_1d,
    whole_state,
)
from colossal.legacy.nn.layer._native import Initializer, native_linear
from colossal.shardformer.layer import (
    Classifier2D,
    Classifier2p5D,
    Classifier3D,
    Linear1D_Col,
    Linear1D_Row,
    Linear2D,
    Linear2p5D,
    Linear3D,
    VocabParallelClassifier2D,
    VocabParallelClassifier2p5D,
    VocabParallelClassifier3D,
    VocabParallelLMHead1D,
)

__all__ = ["Classifier", "Linear", "VocabParallelClassifier"]


def _tied(linear: nn.Linear, weight: nn.Parameter | None, name: str) -> nn.Linear:
    if weight is not None:
        if tuple(weight.shape) != tuple(linear.weight.shape):
            raise ValueError(
                f"colossalai.nn.{name}: the shared weight has shape {tuple(weight.shape)}, "
                f"not the ({linear.out_features}, {linear.in_features}) of this layer"
            )
        linear.weight = weight
    return linear


def _split_columns(weight: torch.Tensor, in_features: int) -> bool:
    """Whether ``weight`` is a 1D Embedding's: its width split over the 1D group."""
    spec = shard_spec(weight)
    return (
        spec is not None
        and tuple(spec.shape)[1:] == (in_features,)
        and (int(weight.shape[1]) != in_features)
    )


def _agreed_native(
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype | None,
    weight_initializer: Initializer | None,
    bias_initializer: Initializer | None,
) -> nn.Linear:
    """The whole ``nn.Linear`` every tensor-parallel rank builds alike."""
    return agreed(
        lambda: native_linear(
            in_features, out_features, bias, dtype, weight_initializer, bias_initializer
        ),
        grid_dims().group("tp"),
    )


class Linear(metaclass=ModeDispatch):
    """``colossalai.nn.Linear``: the linear layer of the config's tensor mode.

    Args:
        in_features: Whole input width.
        out_features: Whole output width.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        weight_initializer: ColossalAI-style ``init(tensor, fan_in=, fan_out=)`` for the
            whole weight (None: torch's ``nn.Linear`` initialization).
        bias_initializer: The same for the bias.
        gather_output: ``'1d'``: a column-parallel layer gathers its output whole.
        **kwargs: ``skip_bias_add=False`` is accepted; other ColossalAI-only arguments
            raise.

    Returns:
        The mode's module (``nn.Linear``, ``Linear1D_Col``/``Linear1D_Row``, ``Linear2D``,
        ``Linear2p5D``, ``Linear3D``); ``isinstance(m, Linear)`` holds for each.

    Raises:
        NotImplementedError: ``skip_bias_add=True`` or an unknown tensor mode.
        ValueError: The widths do not divide as the mode needs.
    """

    _kinds = (nn.Linear, Linear1D_Col, Linear1D_Row, Linear2D, Linear2p5D, Linear3D)

    def __new__(  # type: ignore[misc]
        cls,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        gather_output: bool = False,
        **kwargs: Any,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        if kwargs.pop("skip_bias_add", False):
            raise NotImplementedError(
                "colossalai.nn.Linear(skip_bias_add=True) is not supported; add the bias "
                "yourself from a bias=False layer"
            )
        if kwargs:
            raise TypeError(f"colossalai.nn.Linear got unexpected arguments {sorted(kwargs)}")
        mode = tensor_mode("Linear")
        inits = (weight_initializer, bias_initializer)
        if mode in (None, "sequence"):
            return native_linear(in_features, out_features, bias, dtype, *inits)
        native = _agreed_native(in_features, out_features, bias, dtype, *inits)
        env = layer_env()
        if mode == "1d":
            group = tp_group_1d()
            if not env.parallel_input and not gather_output:
                env.parallel_input = True
                return whole_state(Linear1D_Col.from_native_module(native, group))
            if not env.parallel_input:  # gather_output: whole in, whole out
                return whole_state(
                    Linear1D_Col.from_native_module(native, group, gather_output=True)
                )
            env.parallel_input = False
            return whole_state(Linear1D_Row.from_native_module(native, group))
        dims = grid_dims()
        if mode == "2d":
            return whole_state(Linear2D.from_native_module(native, dims))
        if mode == "2.5d":
            return whole_state(Linear2p5D.from_native_module(native, dims))
        layer = Linear3D.from_native_module(native, dims, swapped=env.swapped_3d)
        env.swapped_3d = layer.output_swapped
        return whole_state(layer)


class Classifier(metaclass=ModeDispatch):
    """``colossalai.nn.Classifier``: a classification head of the config's tensor mode.

    Above ``vocab_parallel_limit`` classes (with tensor parallelism) it is a
    :class:`VocabParallelClassifier`, as in ColossalAI. The logits are whole along the
    classes: on every rank (None, ``'1d'``), or for this rank's rows (2D/2.5D/3D).

    Args:
        in_features: Whole input width.
        num_classes: Classes.
        weight: A weight shared with an embedding of the same mode, or None.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        weight_initializer: ColossalAI-style initializer of the whole weight.
        bias_initializer: The same for the bias.
        vocab_parallel_limit: The most classes of a non-vocab-parallel head.

    Raises:
        NotImplementedError: A shared whole weight with a split input in ``'1d'``, or an
            unknown tensor mode.
    """

    _kinds = (nn.Linear, Linear1D_Row, Classifier2D, Classifier2p5D, Classifier3D)

    def __new__(  # type: ignore[misc]
        cls,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
        vocab_parallel_limit: int = 2048,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("Classifier")
        inits = (weight_initializer, bias_initializer)
        if mode in (None, "sequence"):
            native = native_linear(in_features, num_classes, bias, dtype, *inits)
            return _tied(native, weight, "Classifier")
        if num_classes > vocab_parallel_limit:
            return VocabParallelClassifier(in_features, num_classes, weight, bias, dtype, *inits)
        native = _agreed_native(in_features, num_classes, bias, dtype, *inits)
        env = layer_env()
        dims = grid_dims()
        if mode == "1d":
            if weight is not None and _split_columns(weight, in_features):
                # tied to a 1D Embedding (its width split): row-parallel over that parameter
                bias_param = native.bias if bias else None
                row = Linear1D_Row(
                    in_features, num_classes, weight, bias_param, tp_group_1d(),
                    parallel_input=env.parallel_input,
                )  # fmt: skip
                env.parallel_input = False
                return whole_state(row)
            if weight is not None:
                if env.parallel_input:
                    raise NotImplementedError(
                        "colossalai.nn.Classifier with a shared weight in '1d' takes a whole "
                        "input; put it after a row-parallel layer"
                    )
                return _tied(native, weight, "Classifier")
            layer = Linear1D_Row.from_native_module(
                native, tp_group_1d(), parallel_input=env.parallel_input
            )
            env.parallel_input = False
            return whole_state(layer)
        if mode == "2d":
            return whole_state(Classifier2D.from_native_module(native, dims, weight=weight))
        if mode == "2.5d":
            return whole_state(Classifier2p5D.from_native_module(native, dims, weight=weight))
        return whole_state(
            Classifier3D.from_native_module(native, dims, swapped=env.swapped_3d, weight=weight)
        )


class VocabParallelClassifier(metaclass=ModeDispatch):
    """``colossalai.nn.VocabParallelClassifier``: a head whose classes are split over ranks.

    The logits hold this rank's classes (every class without tensor parallelism); use
    :class:`~colossal.legacy.nn.loss.VocabParallelCrossEntropyLoss` on them. ``weight``
    ties it to a ``VocabParallelEmbedding`` of the same mode.

    Args:
        in_features: Whole input width.
        num_classes: Classes.
        weight: A weight shared with a vocab-parallel embedding, or None.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype.
        weight_initializer: ColossalAI-style initializer of the whole weight.
        bias_initializer: The same for the bias.

    Raises:
        NotImplementedError: A split input in ``'1d'``, or an unknown tensor mode.
    """

    _kinds = (
        nn.Linear,
        VocabParallelLMHead1D,
        VocabParallelClassifier2D,
        VocabParallelClassifier2p5D,
        VocabParallelClassifier3D,
    )

    def __new__(  # type: ignore[misc]
        cls,
        in_features: int,
        num_classes: int,
        weight: nn.Parameter | None = None,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        weight_initializer: Initializer | None = None,
        bias_initializer: Initializer | None = None,
    ) -> nn.Module:
        """The module of the config's tensor mode (see the class docstring)."""
        mode = tensor_mode("VocabParallelClassifier")
        inits = (weight_initializer, bias_initializer)
        if mode in (None, "sequence"):
            native = native_linear(in_features, num_classes, bias, dtype, *inits)
            return _tied(native, weight, "VocabParallelClassifier")
        native = _agreed_native(in_features, num_classes, bias, dtype, *inits)
        env = layer_env()
        dims = grid_dims()
        if mode == "1d":
            if env.parallel_input:
                raise NotImplementedError(
                    "colossalai.nn.VocabParallelClassifier in '1d' takes a whole input; put "
                    "it after a row-parallel layer"
                )
            if weight is not None:
                native.weight = weight
            layer = VocabParallelLMHead1D.from_native_module(
                native, tp_group_1d(), make_vocab_size_divisible_by=1
            )
            return whole_state(layer)
        if mode == "2d":
            return whole_state(
                VocabParallelClassifier2D.from_native_module(native, dims, weight=weight)
            )
        if mode == "2.5d":
            return whole_state(
                VocabParallelClassifier2p5D.from_native_module(native, dims, weight=weight)
            )
        layer3d = VocabParallelClassifier3D.from_native_module(
            native, dims, swapped=env.swapped_3d, weight=weight
        )
        env.swapped_3d = layer3d.output_swapped
        return whole_state(layer3d)
