"""ResNet split by ``PipelinableContext`` and trained with the Trainer ("Pipeline Parallel").

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/resnet_pipeline/train_resnet_pipelinable.py``

The page's code with these changes: torchvision's ``resnet50`` -> a small ResNet with the
same layout and ``Bottleneck`` blocks (``stand_ins.resnet``); titans' ``build_cifar`` ->
digits upscaled to 16x16 RGB (``stand_ins.digits``) with ``drop_last=True`` (a batch must
split into ``NUM_MICRO_BATCHES``); ``--backend`` defaults to gloo; ``NUM_EPOCHS`` from the
environment (2 on the page); ``--no-progress`` for tests.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import colossalai.nn as col_nn  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from colossalai.context import ParallelMode  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import disable_existing_loggers, get_dist_logger  # noqa: E402
from colossalai.pipeline.pipelinable import PipelinableContext  # noqa: E402
from colossalai.trainer import Trainer, hooks  # noqa: E402
from colossalai.utils import MultiTimer, get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.resnet import resnet_tiny_bottleneck  # noqa: E402


def build_digits(batch_size):
    """titans' ``build_cifar(batch_size, root, padding=4, crop=32, resize=32)`` on the digits."""
    train_dataset, test_dataset = digits_datasets(image_size=16, channels=3)
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=batch_size, drop_last=True
    )
    test_dataloader = get_dataloader(dataset=test_dataset, batch_size=batch_size, drop_last=True)
    return train_dataloader, test_dataloader


# Define some config
BATCH_SIZE = 64
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "4"))
NUM_CHUNKS = 1
CONFIG = dict(NUM_MICRO_BATCHES=4, parallel=dict(pipeline=2))


def train():
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    # Train
    disable_existing_loggers()
    parser = colossalai.get_default_parser()
    parser.set_defaults(backend="gloo")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    colossalai.launch_from_torch(backend=args.backend, config=CONFIG)
    logger = get_dist_logger()
    pipelinable = PipelinableContext()

    # build model
    with pipelinable:
        model = resnet_tiny_bottleneck(num_classes=10)  # resnet50() on the page

    # define an execution sequence
    exec_seq = [
        "conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool",
        (lambda x: torch.flatten(x, 1), "behind"), "fc",
    ]  # fmt: skip
    pipelinable.to_layer_list(exec_seq)

    # partition the model into pipeline
    model = pipelinable.partition(
        NUM_CHUNKS, gpc.pipeline_parallel_size, gpc.get_local_rank(ParallelMode.PIPELINE)
    )

    # build criterion
    criterion = nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # build dataloader
    train_dataloader, test_dataloader = build_digits(BATCH_SIZE)

    lr_scheduler = col_nn.lr_scheduler.LinearWarmupLR(optimizer, NUM_EPOCHS, warmup_steps=1)
    engine, train_dataloader, test_dataloader, lr_scheduler = colossalai.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader, lr_scheduler
    )
    timer = MultiTimer()

    trainer = Trainer(engine=engine, timer=timer, logger=logger)

    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(col_nn.metric.Accuracy()),
        hooks.LogMetricByEpochHook(logger),
        hooks.LRSchedulerHook(lr_scheduler, by_epoch=True),
    ]

    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=NUM_EPOCHS,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress=not args.no_progress,
    )


if __name__ == "__main__":
    train()
