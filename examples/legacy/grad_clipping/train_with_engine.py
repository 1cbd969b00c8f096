"""Gradient clipping through the config ("Gradient Clipping").

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/grad_clipping/train_with_engine.py``

The page's hands-on example (ColossalAI-Examples ``features/gradient_clipping``: a ResNet on
CIFAR-10 trained with the engine) with a small ResNet (``stand_ins.resnet``) on digits
(``stand_ins.digits``). To show the clipping, the optimizer is plain SGD (no momentum, no
weight decay), so a step moves the parameters by exactly ``lr * min(norm, clip_grad_norm)``;
each epoch logs the largest gradient norm seen before clipping and the largest deviation of
an update from that.
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
    lr, clip = gpc.config.LEARNING_RATE, gpc.config.clip_grad_norm
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    engine, train_dataloader, _, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader
    )

    params = [p for p in model.parameters() if p.requires_grad]
    for epoch in range(gpc.config.NUM_EPOCHS):
        engine.train()
        epoch_loss, steps, largest_norm, worst_error = 0.0, 0, 0.0, 0.0
        for img, label in train_dataloader:
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            # the gradients are averaged over the data-parallel ranks here (DDP)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
            before = [p.detach().clone() for p in params]
            engine.step()
            deltas = [p - b for p, b in zip(params, before, strict=True)]
            moved = torch.nn.utils.get_total_norm(deltas).item()
            expected = lr * min(norm, clip)
            largest_norm = max(largest_norm, norm)
            worst_error = max(worst_error, abs(moved - expected) / expected)
            epoch_loss, steps = epoch_loss + train_loss.item(), steps + 1
        logger.info(
            f"Epoch {epoch} - train loss: {epoch_loss / steps:.5}, largest gradient norm "
            f"before clipping: {largest_norm:.5}, largest relative deviation of an update "
            f"from lr * min(norm, {clip}): {worst_error:.3e}",
            ranks=[0],
        )
    gpc.destroy()


if __name__ == "__main__":
    main()
