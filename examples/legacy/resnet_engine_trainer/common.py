"""Steps 2-4 of "Use Engine and Trainer in Training", shared by both scripts.

The page's code with two changes, nothing else: the model is a small ResNet with
torchvision's layout (``stand_ins.resnet``) instead of ``torchvision.models.resnet34``, and
the data is scikit-learn's digits upscaled to 16x16 RGB (``stand_ins.digits``) instead of a
CIFAR-10 download. ``launch_from_torch`` gets ``backend='gloo'`` (CPU) and the config's path
relative to this file, so the scripts run from any directory.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.nn.lr_scheduler import CosineAnnealingLR  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.resnet import resnet_tiny  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")


def build_components():
    """Launch, then build and initialize the ResNet, its data, loss, optimizer and scheduler.

    Returns:
        ``(engine, train_dataloader, test_dataloader, lr_scheduler, logger)``.
    """
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    # Step 2: initialize the distributed environment from ./config.py
    colossalai.launch_from_torch(config=CONFIG, backend="gloo")

    # Step 3: build logger, model, datasets, dataloaders, criterion, optimizer, lr_scheduler
    logger = get_dist_logger()
    model = resnet_tiny(num_classes=10)  # torchvision's resnet34(num_classes=10) on the page
    train_dataset, test_dataset = digits_datasets(image_size=16, channels=3)  # CIFAR10 there

    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=gpc.config.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )
    test_dataloader = get_dataloader(
        dataset=test_dataset,
        add_sampler=False,
        batch_size=gpc.config.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=gpc.config.NUM_EPOCHS)

    # Step 4: initialize with Colossal-AI
    engine, train_dataloader, test_dataloader, _ = colossalai.initialize(
        model,
        optimizer,
        criterion,
        train_dataloader,
        test_dataloader,
    )
    return engine, train_dataloader, test_dataloader, lr_scheduler, logger
