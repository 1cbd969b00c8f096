"""Step 6 of "Use Engine and Trainer in Training": train the ResNet with the trainer.

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/resnet_engine_trainer/run_resnet_cifar10_with_trainer.py``

The page's code; ``display_progress`` is off when ``NO_PROGRESS`` is set (tests).
"""

import os

from colossalai.core import global_context as gpc
from colossalai.nn.metric import Accuracy
from colossalai.trainer import Trainer, hooks
from common import build_components


def main() -> None:
    engine, train_dataloader, test_dataloader, lr_scheduler, logger = build_components()

    # create a trainer object
    trainer = Trainer(engine=engine, logger=logger)

    # define the hooks to attach to the trainer
    hook_list = [
        hooks.LossHook(),
        hooks.LRSchedulerHook(lr_scheduler=lr_scheduler, by_epoch=True),
        hooks.AccuracyHook(accuracy_func=Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LogMemoryByEpochHook(logger),
    ]

    # start training
    # run testing every 1 epoch
    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=gpc.config.NUM_EPOCHS,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress="NO_PROGRESS" not in os.environ,
    )
    gpc.destroy()


if __name__ == "__main__":
    main()
