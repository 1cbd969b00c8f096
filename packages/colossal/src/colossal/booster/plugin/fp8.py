"""The plugins' float8 options: DDP's fp8 gradient hook, and the refusal of ``use_fp8``.

``fp8_communication=True`` compresses a plugin's gradient (and, for ZeRO, parameter)
collectives through :mod:`colossal.core.comm.fp8`; ``use_fp8=True`` (ColossalAI's float8
matmuls through ``torch._scaled_mm``) needs a CUDA device of compute capability 8.9 or more and
is refused elsewhere by :func:`require_fp8_matmul`, naming what is missing.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from colossal.core.comm import fp8_all_reduce

__all__ = ["fp8_allreduce_hook", "fp8_matmul_missing", "require_fp8_matmul"]


def fp8_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A ``DistributedDataParallel`` comm hook averaging each gradient bucket through float8.

    Register with ``ddp.register_comm_hook(process_group, fp8_allreduce_hook)``. The bucket is
    averaged by :func:`colossal.core.comm.fp8_all_reduce` (e4m3, one scale per piece; each
    element within 6.25% of every rank's gradient plus the re-encoded sum) before the hook
    returns: the reduction is synchronous, the returned future already complete.
    """
    buffer = bucket.buffer()
    fp8_all_reduce(buffer, op=ReduceOp.AVG, group=process_group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def fp8_matmul_missing() -> str | None:
    """What this process lacks for float8 matmuls (``torch._scaled_mm``), or None."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if not torch.cuda.is_available():
        return "no CUDA device is available (this process computes on the CPU)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        return f"the CUDA device {name!r} has compute capability {major}.{minor}, not 8.9+"
    return None


def require_fp8_matmul(owner: str) -> None:
    """Refuse ``use_fp8=True``: say what float8 matmuls need and what this process lacks.

    Raises:
        NotImplementedError: Always: where the hardware lacks float8 matmuls it names what is
            missing; on a capable GPU it says that Colossal's fp8 linear layers are not written
            yet.
    """
    missing = fp8_matmul_missing()
    if missing is not None:
        raise NotImplementedError(
            f"{owner}(use_fp8=True) runs linear layers as float8 matmuls (torch._scaled_mm), "
            f"which need a CUDA GPU of compute capability 8.9+ (Ada, Hopper): {missing}. "
            "Pass use_fp8=False (fp8_communication=True compresses communication instead)"
        )
    raise NotImplementedError(
        f"{owner}(use_fp8=True): this GPU has float8 matmuls, but Colossal has no float8 "
        "linear layers yet; pass use_fp8=False (fp8_communication=True compresses "
        "communication)"
    )
