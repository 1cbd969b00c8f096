"""ViT with pipeline parallelism and the engine ("Step By Step: Accelerate ViT Training").

Run (pipeline 2 x data 2): ``python3 -m colossal.cli run --nproc_per_node 4
examples/legacy/vit_step_by_step/train_hybrid.py --config
examples/legacy/vit_step_by_step/configs/config_pipeline_parallel.py``

The page's script with these changes: CIFAR-10 -> digits (``stand_ins.digits``) with
``drop_last=True`` (a batch must split into ``NUM_MICRO_BATCHES``); ``backend='gloo'``; the
data iterator made per epoch (the page makes it once, which runs dry after one epoch); the
scheduler stepped per epoch (its ``total_steps`` are epochs); the epoch's mean loss logged on
the last pipeline stage (the page logs nothing); ``--no-progress`` for tests.

The tensor parallel configs run the same script: ``configs/config_2d.py`` on 4 processes
(``tensor=dict(size=4, mode='2d')``) and ``configs/config_3d.py`` on 8 (``mode='3d'``); the
model zoo's ViT is built of ``colossalai.nn`` layers, which take the config's mode.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.context import ParallelMode  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.nn import CrossEntropyLoss  # noqa: E402
from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR  # noqa: E402
from colossalai.utils import get_dataloader, is_using_pp  # noqa: E402
from model.vit import build_pipeline_vit  # noqa: E402
from model_zoo.vit.vit import _create_vit_model  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from tqdm import tqdm  # noqa: E402


def build_digits(batch_size):
    """The page's ``build_cifar(batch_size)`` on the digits."""
    train_dataset, test_dataset = digits_datasets(image_size=gpc.config.IMG_SIZE)
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=batch_size, pin_memory=True,
        drop_last=True,
    )  # fmt: skip
    test_dataloader = get_dataloader(
        dataset=test_dataset, batch_size=batch_size, pin_memory=True, drop_last=True
    )
    return train_dataloader, test_dataloader


def main() -> None:
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    # initialize distributed setting
    parser = colossalai.get_default_parser()
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()

    # launch from torch
    colossalai.launch_from_torch(config=args.config, backend="gloo")

    # get logger
    logger = get_dist_logger()
    logger.info("initialized distributed environment", ranks=[0])

    if hasattr(gpc.config, "LOG_PATH"):
        if gpc.get_global_rank() == 0:
            log_path = gpc.config.LOG_PATH
            if not os.path.exists(log_path):
                os.mkdir(log_path)
            logger.log_to_file(log_path)

    use_pipeline = is_using_pp()

    # create model
    model_kwargs = dict(
        img_size=gpc.config.IMG_SIZE,
        patch_size=gpc.config.PATCH_SIZE,
        in_chans=gpc.config.IN_CHANS,  # 3 on the page (RGB)
        dim=gpc.config.HIDDEN_SIZE,
        depth=gpc.config.DEPTH,
        num_heads=gpc.config.NUM_HEADS,
        mlp_ratio=gpc.config.MLP_RATIO,
        num_classes=gpc.config.NUM_CLASSES,
        init_method="jax",
        checkpoint=gpc.config.CHECKPOINT,
    )

    if use_pipeline:
        model = build_pipeline_vit(num_layers=model_kwargs["depth"], num_chunks=1, **model_kwargs)
    else:
        model = _create_vit_model(**model_kwargs)

    # count number of parameters
    total_numel = 0
    for p in model.parameters():
        total_numel += p.numel()
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        pipeline_stage = 0
    else:
        pipeline_stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    logger.info(f"number of parameters: {total_numel} on pipeline stage {pipeline_stage}")

    # create dataloaders
    train_dataloader, test_dataloader = build_digits(gpc.config.BATCH_SIZE)

    # create loss function
    criterion = CrossEntropyLoss(label_smoothing=0.1)

    # create optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=gpc.config.LEARNING_RATE, weight_decay=gpc.config.WEIGHT_DECAY
    )

    # create lr scheduler
    lr_scheduler = CosineAnnealingWarmupLR(
        optimizer=optimizer,
        total_steps=gpc.config.NUM_EPOCHS,
        warmup_steps=gpc.config.WARMUP_EPOCHS,
    )

    # initialize
    engine, train_dataloader, test_dataloader, _ = colossalai.initialize(
        model=model,
        optimizer=optimizer,
        criterion=criterion,
        train_dataloader=train_dataloader,
        test_dataloader=test_dataloader,
    )

    logger.info("Engine is built", ranks=[0])

    for epoch in range(gpc.config.NUM_EPOCHS):
        # training
        engine.train()
        data_iter = iter(train_dataloader)

        if gpc.get_global_rank() == 0 and not args.no_progress:
            description = f"Epoch {epoch} / {gpc.config.NUM_EPOCHS}"
            progress = tqdm(range(len(train_dataloader)), desc=description)
        else:
            progress = range(len(train_dataloader))
        losses = []
        for _ in progress:
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(data_iter, return_output_label=False)
            engine.step()
            if loss is not None:  # the last pipeline stage has the loss
                losses.append(loss.item())
        lr_scheduler.step()
        # one line per epoch: the first data-parallel replica's first tensor-parallel rank
        # (the page logs nothing; under tensor parallelism every rank has the loss)
        first = gpc.get_local_rank(ParallelMode.DATA) == 0
        if losses and first and gpc.get_local_rank(ParallelMode.TENSOR) == 0:
            print(f"Epoch {epoch} - train loss: {sum(losses) / len(losses):.5}", flush=True)
    gpc.destroy()


if __name__ == "__main__":
    main()
