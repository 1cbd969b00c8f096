"""THE name table: ColossalAI's import paths -> Colossal's modules and objects.

One row per ColossalAI module path (see :mod:`colossalai._entries` for the row types).
``colossalai.X`` is served by a thin alias module whose attributes are our objects; nothing
is copied. A path with no row is served only when a ``tree=True`` ancestor maps it one to
one; anything else raises an ImportError that names our equivalent or the issue to watch.

Adding a name (issue 36 and later): add a row, or a ``names`` item to an existing row, in
the section it belongs to. Config-era rows are also served under ``colossalai.legacy.*``
(ColossalAI's own path for that API), so they are written once, in ``CONFIG_ERA``.
"""

from __future__ import annotations

from colossalai._entries import ISSUE_TODAY, Row, Served, missing, served

__all__ = ["BOOSTER_ERA", "CONFIG_ERA", "OTHER", "TABLE", "TOP_LEVEL"]

_GEMINI_OLD = (
    "GeminiDDP manages its chunks and their placement itself: colossal.gemini.GeminiDDP "
    "(ChunkManager and the memory tracer are in colossal.gemini)"
)
_LAZY_INIT = (
    "build the model under colossal.lazy.LazyInitContext (colossalai.lazy) and let the "
    "Booster's plugin shard it; ColoInitContext is not implemented"
)

#: Names of the ``colossalai`` package itself (its own ``launch*`` and ``__version__`` are
#: defined in ``colossalai/__init__.py``).
TOP_LEVEL: Served = served(
    names={
        "get_default_parser": "colossal.legacy:get_default_parser",
        "initialize": "colossal.legacy.initialize:initialize",
        # The seeds' AMP page writes `from colossalai import Booster`; ColossalAI itself exports
        # it only from colossalai.booster. Served so the page runs as written.
        "Booster": "colossal.booster:Booster",
    },
    hints={
        # The seeds' AMP page says "call colossalai.boost"; ColossalAI has no such function.
        "boost": "ColossalAI has no colossalai.boost: create a Booster (colossalai.booster) and "
        "call booster.boost(model, optimizer, criterion, dataloader, lr_scheduler)",
    },
)

#: Today's ColossalAI (the Booster API and what it stands on).
BOOSTER_ERA: dict[str, Row] = {
    "colossalai.booster": served("colossal.booster", tree=True, issue=None),
    "colossalai.booster.plugin": served("colossal.booster.plugin", tree=True, issue=None),
    # The seeds' AMP page imports FP16TorchMixedPrecision from here (ColossalAI's own path is
    # colossalai.booster.mixed_precision, served through the booster tree).
    "colossalai.mixed_precision": served("colossal.booster.mixed_precision", issue=None),
    "colossalai.checkpoint_io": served("colossal.checkpoint_io", tree=True, issue=None),
    "colossalai.checkpoint_io.general_checkpoint_io": served(
        names={"GeneralCheckpointIO": "colossal.checkpoint_io:GeneralCheckpointIO"},
    ),
    "colossalai.cluster": served(
        names={
            "DistCoordinator": "colossal.core:DistCoordinator",
            "ProcessGroupMesh": "colossal.core:ProcessGroupMesh",
        },
    ),
    "colossalai.cluster.dist_coordinator": served(
        names={
            "DistCoordinator": "colossal.core:DistCoordinator",
            # module-level in ColossalAI; ours is DistCoordinator().priority_execution()
            "priority_execution": "colossalai._shims:priority_execution",
        },
    ),
    "colossalai.cluster.process_group_mesh": served(
        names={"ProcessGroupMesh": "colossal.core:ProcessGroupMesh"},
    ),
    "colossalai.accelerator": served(
        "colossal.core.accelerator",
        hints={
            "set_accelerator": "set COLOSSAL_ACCELERATOR=cpu or cuda before the first "
            "get_accelerator() call",
            "auto_set_accelerator": "get_accelerator() picks CUDA when available, else CPU",
            "NpuAccelerator": "not implemented in Colossal (CUDA and CPU accelerators only)",
        },
        issue=ISSUE_TODAY,
    ),
    "colossalai.interface": served(
        names={
            "ModelWrapper": "colossal.core:ModelWrapper",
            "OptimizerWrapper": "colossal.core:OptimizerWrapper",
        },
    ),
    "colossalai.lazy": served("colossal.lazy", tree=True, issue=None),
    "colossalai.logging": served(
        names={
            "get_dist_logger": "colossal.core:get_dist_logger",
            "disable_existing_loggers": "colossal.core:disable_existing_loggers",
            "DistributedLogger": "colossal.core:DistributedLogger",
        },
    ),
    # ColossalAI's spawn calls func(rank, world_size=, port=) before any launch: ours is
    # spawn_with_port (colossal.core.testing.spawn launches the group first).
    "colossalai.testing": served(
        "colossal.core.testing",
        names={"spawn": "colossal.core.testing:spawn_with_port"},
        issue=None,
    ),
    "colossalai.testing.utils": served(
        "colossal.core.testing.decorators",
        names={
            "spawn": "colossal.core.testing:spawn_with_port",
            "free_port": "colossal.core.testing:free_port",
            "DummyDataloader": "colossal.core.testing:DummyDataloader",
        },
        issue=None,
    ),
    "colossalai.testing.pytest_wrapper": served(
        names={"run_on_environment_flag": "colossal.core.testing:run_on_environment_flag"},
    ),
    "colossalai.testing.comparison": served(
        names={
            "assert_close": "colossal.core.testing:assert_close",
            "assert_close_loose": "colossal.core.testing:assert_close_loose",
            "assert_equal": "colossal.core.testing:assert_equal",
            "assert_not_equal": "colossal.core.testing:assert_not_equal",
            "check_state_dict_equal": "colossal.core.testing:check_state_dict_equal",
            "assert_equal_in_group": "colossal.core.testing:assert_equal_in_group",
            "assert_hf_output_close": "colossal.core.testing:assert_hf_output_close",
        },
    ),
    "colossalai.testing.random": served("colossal.core.testing.seeding", issue=None),
    "colossalai.nn.optimizer": served(
        names={
            "HybridAdam": "colossal.kernels:HybridAdam",
            "CPUAdam": "colossal.kernels:CPUAdam",
            "FusedAdam": "colossal.kernels:FusedAdam",
            "Lamb": "colossal.legacy.nn.optimizer:Lamb",
        },
    ),
    "colossalai.nn.optimizer.hybrid_adam": served(
        names={"HybridAdam": "colossal.kernels:HybridAdam"}
    ),
    "colossalai.nn.optimizer.cpu_adam": served(names={"CPUAdam": "colossal.kernels:CPUAdam"}),
    "colossalai.nn.optimizer.fused_adam": served(names={"FusedAdam": "colossal.kernels:FusedAdam"}),
    "colossalai.nn.optimizer.lamb": served(names={"Lamb": "colossal.legacy.nn.optimizer:Lamb"}),
    "colossalai.nn.lr_scheduler": served("colossal.nn.lr_scheduler", issue=None),
    "colossalai.pipeline": served(
        "colossal.pipeline",
        tree=True,
        names={  # the config-era colossalai.pipeline (pipelinable.py)
            "PipelinableContext": "colossal.legacy.pipeline:PipelinableContext",
            "PipelinableModel": "colossal.legacy.pipeline:PipelinableModel",
        },
    ),
    "colossalai.pipeline.pipelinable": served("colossal.legacy.pipeline.pipelinable"),
    "colossalai.pipeline.schedule": served(
        names={
            "PipelineSchedule": "colossal.pipeline:PipelineSchedule",
            "OneForwardOneBackwardSchedule": "colossal.pipeline:OneForwardOneBackwardSchedule",
            "InterleavedSchedule": "colossal.pipeline:InterleavedSchedule",
            "ZeroBubbleVPipeScheduler": "colossal.pipeline:ZeroBubbleVPipeScheduler",
        },
    ),
    # ZB-V from F/B/W costs: our PipelineGraph fills the order from zero_bubble_v and the
    # times from the simulator (colossal.pipeline.v_schedule); weight_grad_store is served
    # through the colossalai.pipeline tree.
    "colossalai.pipeline.schedule.v_schedule": served("colossal.pipeline.v_schedule"),
    "colossalai.pipeline.schedule.zero_bubble_pp": served(
        names={"ZeroBubbleVPipeScheduler": "colossal.pipeline:ZeroBubbleVPipeScheduler"},
    ),
    "colossalai.shardformer": served("colossal.shardformer", tree=True, issue=None),
    "colossalai.shardformer.layer": served(
        "colossal.shardformer.layer",
        tree=True,
        names={"LinearWithGradAccum": "colossal.pipeline:LinearWithGradAccum"},
    ),
    "colossalai.shardformer.layer._operation": served(
        names={
            "LinearWithGradAccum": "colossal.pipeline:LinearWithGradAccum",
            "linear_with_grad_accum": "colossal.pipeline.weight_grad_store:linear_with_grad_accum",
        },
    ),
    # ColossalAI's distributed-tensor helpers on our marked sharded tensors / torch DTensors
    # (colossalai.tensor itself is the config-era ColoTensor row).
    "colossalai.tensor.d_tensor": served("colossal.shardformer.d_tensor"),
    "colossalai.tensor.d_tensor.api": served("colossal.shardformer.d_tensor"),
    "colossalai.zero.gemini": served(
        "colossal.gemini",
        tree=True,
        issue=None,
        note="today's GeminiDDP signature; colossalai.zero.GeminiDDP is the seeds' one",
    ),
    "colossalai.zero.low_level": served(
        names={"LowLevelZeroOptimizer": "colossal.zero:LowLevelZeroOptimizer"},
    ),
    # fp8 communication is the plugins' fp8_communication=True (ColossalAI's usual way in);
    # the row is the package's, so colossalai.quantization.fp8 raises this hint too.
    "colossalai.quantization": missing(
        "ColossalAI's fp8 helpers (colossalai.quantization.fp8: all_reduce_fp8, "
        "reduce_scatter_fp8, all_gather_fp8, all_to_all_single_fp8, cast_to_fp8...) and its "
        "bnb quantization are not served under their names: pass fp8_communication=True to "
        "the plugin or LowLevelZeroOptimizer, or call colossal.core.comm's fp8_all_reduce / "
        "fp8_reduce_scatter / fp8_all_gather / fp8_all_to_all / fp8_send / fp8_recv (Fp8Codec "
        "encodes and decodes); linear_fp8 is colossal.kernels.fp8.linear_fp8 (what the hybrid "
        "plugins' use_fp8=True runs)"
    ),
    "colossalai.gemini": served(  # the seeds' old path of the Gemini internals
        "colossal.gemini",
        tree=True,
        hints={"GeminiManager": _GEMINI_OLD},
        issue=None,
    ),
}

#: The config-era API (ColossalAI <= 0.2 top-level paths); each row is also served under
#: ``colossalai.legacy`` (``colossalai.context`` and ``colossalai.legacy.context`` alike).
CONFIG_ERA: dict[str, Row] = {
    "colossalai.amp": served("colossal.legacy.amp", tree=True),
    "colossalai.amp.apex_amp": missing(
        "AMP_TYPE.APEX (NVIDIA apex) is not supported: use AMP_TYPE.TORCH (autocast + dynamic "
        "loss scaling, apex O1) or AMP_TYPE.NAIVE (fp16 model + fp32 master weights, apex O2)"
    ),
    "colossalai.builder": served("colossal.legacy.builder", tree=True),
    "colossalai.builder.pipeline": served(
        "colossal.legacy.builder.pipeline",
        names={  # ColossalAI had them in builder/pipeline.py; ours are in builder.partition
            "partition_uniform": "colossal.legacy.builder:partition_uniform",
            "partition_balanced": "colossal.legacy.builder:partition_balanced",
        },
    ),
    "colossalai.communication": missing(
        "the config-era p2p helpers (send_forward, recv_backward...) are not served; pipeline "
        "stages talk through colossal.pipeline.PipelineP2P, which the schedules drive"
    ),
    "colossalai.constants": served("colossal.legacy.constants"),
    "colossalai.context": served("colossal.legacy.context", tree=True),
    "colossalai.context.config": served("colossal.legacy.config"),
    "colossalai.context.process_group_initializer": served("colossal.legacy.context.initializer"),
    # the seeds' "Add Your Own Parallel Mode" page calls it dist_group_initializer
    "colossalai.context.dist_group_initializer": served("colossal.legacy.context.initializer"),
    "colossalai.context.random": served("colossal.legacy.context.random"),
    # MoE (the seeds' "Integrate Mixture-of-Experts Into Your Model"): moe_env / MOE_CONTEXT
    "colossalai.context.moe_context": served("colossal.legacy.context.moe_context"),
    "colossalai.core": served("colossal.legacy.core"),
    "colossalai.engine": served("colossal.legacy.engine", tree=True),
    "colossalai.global_variables": served("colossal.legacy.global_variables"),
    "colossalai.nn": served(
        include=("layer", "loss", "lr_scheduler", "metric", "optimizer"),
        note="ColossalAI's nn/__init__ star-imports these five",
    ),
    # The mode-dispatched layers (Linear, LayerNorm, Classifier... and Linear2D/2p5D/3D);
    # colossalai.nn star-imports them, so `col_nn.Linear` resolves.
    "colossalai.nn.layer": served("colossal.legacy.nn.layer", tree=True),
    # the page says "create a MoE layer from colossalai.nn.moe"; ColossalAI's own path is
    # colossalai.nn.layer.moe (served through the layer tree)
    "colossalai.nn.moe": served("colossal.legacy.nn.layer.moe"),
    "colossalai.nn.layer.wrapper": served(
        names={
            "PipelineSharedModuleWrapper": "colossal.legacy.pipeline:PipelineSharedModuleWrapper"
        }
    ),
    "colossalai.nn.loss": served("colossal.legacy.nn.loss", tree=True),
    "colossalai.nn.metric": served("colossal.legacy.nn.metric", tree=True),
    "colossalai.nn.parallel": served(
        names={"GeminiDDP": "colossal.legacy.zero:GeminiDDP"},
        hints={"ZeroDDP": "GeminiDDP (colossalai.zero) is the chunk-based ZeRO-3 model"},
    ),
    "colossalai.registry": served("colossal.legacy.registry"),
    "colossalai.tensor": served("colossal.legacy.tensor", tree=True),
    "colossalai.trainer": served("colossal.legacy.trainer", tree=True),
    "colossalai.utils": served("colossal.legacy.utils", tree=True),
    "colossalai.utils.model": served(
        names={"ColoInitContext": "colossal.legacy.tensor:ColoInitContext"},
    ),
    "colossalai.utils.model.colo_init_context": served(
        names={"ColoInitContext": "colossal.legacy.tensor:ColoInitContext"},
    ),
    "colossalai.zero": served(
        "colossal.legacy.zero",
        names={"GeminiOptimizer": "colossal.gemini:GeminiOptimizer"},
        hints={"ColoInitContext": _LAZY_INIT},
    ),
    "colossalai.zero.wrapper": served(
        names={
            "zero_model_wrapper": "colossal.legacy.zero:zero_model_wrapper",
            "zero_optim_wrapper": "colossal.legacy.zero:zero_optim_wrapper",
        },
    ),
}

#: ColossalAI paths that are neither era's API here: hints for what exists instead.
OTHER: dict[str, Row] = {
    "colossalai.legacy": served(
        "colossal.legacy",
        tree=True,
        names={"initialize": "colossal.legacy.initialize:initialize"},
    ),
    "colossalai.kernel": missing(
        "Colossal's fused kernels are colossal.kernels (FusedLayerNorm, FusedRMSNorm, "
        "attention, CPUAdam/HybridAdam); ColossalAI's kernel loaders are not served",
        ISSUE_TODAY,
    ),
    "colossalai.device": missing(
        "the device mesh is colossal.core.ProcessGroupMesh (colossalai.cluster.ProcessGroupMesh)",
        ISSUE_TODAY,
    ),
}


def _legacy_mirror(rows: dict[str, Row]) -> dict[str, Row]:
    prefix = "colossalai."
    return {f"colossalai.legacy.{path[len(prefix) :]}": row for path, row in rows.items()}


#: Every row: ColossalAI module path -> row. The package ``colossalai`` itself is TOP_LEVEL.
TABLE: dict[str, Row] = {
    **BOOSTER_ERA,
    **_legacy_mirror(CONFIG_ERA),
    **CONFIG_ERA,
    **OTHER,
}
