"""ViT with data parallelism and the Trainer ("Step By Step: Accelerate ViT Training").

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/vit_step_by_step/train_dp.py --config
examples/legacy/vit_step_by_step/configs/config_data_parallel.py``

The page's script with these changes: timm's ``vit_base_patch16_224`` -> a small
``VisionTransformer`` with timm's structure (``stand_ins.timm_vit``); CIFAR-10 -> digits
(``stand_ins.digits``, 8x8 grayscale); ``backend='gloo'``; ``MixupAccuracy`` (not defined
on the page) -> ``Accuracy``; Lamb's ``lr`` 1.8e-2 -> 5e-2 (an epoch here is 11
updates); ``TensorboardHook`` only when tensorboard is installed;
``--no-progress`` for tests. Checkpoints go to ``./ckpt`` (and tensorboard logs to
``./tb_logs``) in the working directory, as on the page.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import disable_existing_loggers, get_dist_logger  # noqa: E402
from colossalai.nn.lr_scheduler import LinearWarmupLR  # noqa: E402
from colossalai.nn.metric import Accuracy  # noqa: E402
from colossalai.trainer import Trainer, hooks  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.timm_vit import VisionTransformer  # noqa: E402


def build_digits(batch_size):
    """The page's ``build_cifar(batch_size)`` on the digits."""
    train_dataset, test_dataset = digits_datasets()
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=batch_size, pin_memory=True
    )
    test_dataloader = get_dataloader(dataset=test_dataset, batch_size=batch_size, pin_memory=True)
    return train_dataloader, test_dataloader


def main() -> None:
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    # initialize distributed setting
    parser = colossalai.get_default_parser()
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    colossalai.launch_from_torch(config=args.config, backend="gloo")

    disable_existing_loggers()
    logger = get_dist_logger()

    # access parameters
    print(gpc.config.BATCH_SIZE)

    # build model
    model = VisionTransformer(  # vit_base_patch16_224(drop_rate=0.1, num_classes=...)
        img_size=8, patch_size=4, in_chans=1, embed_dim=64, depth=2, num_heads=4,
        mlp_ratio=2, drop_rate=gpc.config.DROP_RATE, num_classes=gpc.config.NUM_CLASSES,
    )  # fmt: skip

    # build dataloader
    train_dataloader, test_dataloader = build_digits(gpc.config.BATCH_SIZE)

    # build optimizer (lr 1.8e-2 on the page, for hundreds of steps an epoch)
    optimizer = colossalai.nn.Lamb(model.parameters(), lr=5e-2, weight_decay=0.1)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler (50 of 300 warm-up epochs on the page)
    lr_scheduler = LinearWarmupLR(
        optimizer, warmup_steps=gpc.config.NUM_EPOCHS // 6, total_steps=gpc.config.NUM_EPOCHS
    )

    engine, train_dataloader, test_dataloader, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )

    # build trainer
    trainer = Trainer(engine=engine, logger=logger)

    # build hooks
    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(accuracy_func=Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LRSchedulerHook(lr_scheduler, by_epoch=True),
        # comment if you do not need to use the hooks below
        hooks.SaveCheckpointHook(interval=1, checkpoint_dir="./ckpt"),
    ]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        logger.info("tensorboard is not installed: no TensorboardHook", ranks=[0])
    else:
        hook_list.append(hooks.TensorboardHook(log_dir="./tb_logs", ranks=[0]))

    # start training
    trainer.fit(
        train_dataloader=train_dataloader,
        test_dataloader=test_dataloader,
        epochs=gpc.config.NUM_EPOCHS,
        hooks=hook_list,
        display_progress=not args.no_progress,
        test_interval=1,
    )
    gpc.destroy()


if __name__ == "__main__":
    main()
