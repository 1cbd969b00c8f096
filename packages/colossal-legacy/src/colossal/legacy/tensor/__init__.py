"""The seeds' ColoTensor API (``colossalai.tensor``) on torch's ``DTensor``.

* :mod:`.process_group`: :class:`ProcessGroup` (tp inner, dp outer) as a 2-D device mesh.
* :mod:`.distspec`: :class:`ShardSpec`, :class:`ReplicaSpec`.
* :mod:`.compute_spec`: :class:`ComputePattern`, :class:`ComputeSpec`.
* :mod:`.tensor_spec`: :class:`ColoTensorSpec`.
* :mod:`.colo_tensor`: :class:`ColoTensor`, a thin ``DTensor`` subclass (the design choice is
  documented there); :mod:`.respec`: in-place relayout recorded by autograd.
* :mod:`.colo_parameter`: :class:`ColoParameter`; :mod:`.init_context`: :class:`ColoInitContext`.
* :mod:`.module_io`: :func:`attach_colo_io`, the plain-tensor boundary of a ColoTensor model
  (installed by ``ColoInitContext``): inside, every operator runs on DTensor's sharding
  propagation (the Megatron TP1D patterns of the seeds' GPT-2 tutorial follow from DTensor's
  rules for Shard(-1)/Shard(0) weights); an operator without a strategy raises naming it.

* :mod:`.output_spec`: ``ComputeSpec.set_output_replicate`` acted on (a TP1D module's output
  made whole over tp, or left split).
* :mod:`.state`: :func:`full_state_dict` and plain whole-tensor ``load_state_dict``; Colossal's
  checkpoint IO saves and loads ColoTensor models through its DTensor adapter.
* :mod:`.sdpa`: a DTensor strategy for CPU flash attention (transformers' ``sdpa``).
* :mod:`.gemini_route`: what the seeds' ``GeminiDDP`` does with a ColoTensor model (takes it at
  tp 1, refuses it at tp > 1 naming the supported routes).
"""

from colossal.legacy.tensor import distspec, sdpa  # noqa: F401 - sdpa registers a strategy
from colossal.legacy.tensor.colo_parameter import ColoParameter
from colossal.legacy.tensor.colo_tensor import ColoTensor
from colossal.legacy.tensor.compute_spec import ComputePattern, ComputeSpec
from colossal.legacy.tensor.distspec import DistPlacementPattern, ReplicaSpec, ShardSpec
from colossal.legacy.tensor.init_context import ColoInitContext
from colossal.legacy.tensor.module_io import attach_colo_io
from colossal.legacy.tensor.process_group import ProcessGroup
from colossal.legacy.tensor.state import accept_plain_state, full_state_dict
from colossal.legacy.tensor.tensor_spec import ColoTensorSpec

__all__ = [
    "ColoInitContext",
    "ColoParameter",
    "ColoTensor",
    "ColoTensorSpec",
    "ComputePattern",
    "ComputeSpec",
    "DistPlacementPattern",
    "ProcessGroup",
    "ReplicaSpec",
    "ShardSpec",
    "accept_plain_state",
    "attach_colo_io",
    "distspec",
    "full_state_dict",
]
