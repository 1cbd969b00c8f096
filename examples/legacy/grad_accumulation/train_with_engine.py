"""Gradient accumulation through the config ("Gradient Accumulation").

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/grad_accumulation/train_with_engine.py``

The page's hands-on example (ColossalAI-Examples ``features/gradient_accumulation``: a ResNet
on CIFAR-10 trained with the engine, printing the first elements of a parameter for the first
iterations) with a small ResNet (``stand_ins.resnet``) on digits (``stand_ins.digits``). The
printout shows the parameter unchanged for 3 iterations and updated at the 4th.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.resnet import resnet_tiny  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")


def main() -> None:
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    colossalai.launch_from_torch(config=CONFIG, backend="gloo")
    logger = get_dist_logger()

    model = resnet_tiny(num_classes=10)
    train_dataset, _ = digits_datasets(image_size=16, channels=3)
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=gpc.config.BATCH_SIZE
    )
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    engine, train_dataloader, _, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader
    )

    param = next(model.parameters())
    for epoch in range(gpc.config.NUM_EPOCHS):
        engine.train()
        epoch_loss, steps = 0.0, 0
        for idx, (img, label) in enumerate(train_dataloader):
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
            epoch_loss, steps = epoch_loss + train_loss.item(), steps + 1
            if epoch == 0 and idx < 4:
                first = param.detach().flatten()[:10].tolist()
                logger.info(f"iteration {idx}, first 10 elements of param: {first}", ranks=[0])
        logger.info(f"Epoch {epoch} - train loss: {epoch_loss / steps:.5}", ranks=[0])
    gpc.destroy()


if __name__ == "__main__":
    main()
