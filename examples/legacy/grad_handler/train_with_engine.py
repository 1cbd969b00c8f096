"""A custom gradient handler, registered and named in the config ("Gradient Handler").

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/grad_handler/train_with_engine.py`` (the page runs 4 processes)

The page's ``MyGradientHandler`` with its ``do_something()`` filled in: it averages the
gradients over the data-parallel group, as ColossalAI-Examples' ``features/gradient_handler``
does with ``DataParallelGradientHandler`` in place of PyTorch DDP. The model is a small ResNet
(``stand_ins.resnet``) on digits (``stand_ins.digits``). At the end every rank logs how often
the handler ran and a checksum of its parameters: equal checksums show the replicas stayed in
step although each rank trained on different samples.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from colossalai.context import ParallelMode  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.engine.gradient_handler import BaseGradientHandler  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.registry import GRADIENT_HANDLER  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.resnet import resnet_tiny  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")


@GRADIENT_HANDLER.register_module
class MyGradientHandler(BaseGradientHandler):
    """Averages every gradient over the data-parallel ranks, one all-reduce per parameter."""

    calls = 0

    def handle_gradient(self):
        group = gpc.get_group(ParallelMode.DATA)
        size = gpc.get_world_size(ParallelMode.DATA)
        for param in self._model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(size)
        MyGradientHandler.calls += 1


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
    logger.info(f"model {type(engine.model).__name__}", ranks=[0])

    for epoch in range(gpc.config.NUM_EPOCHS):
        engine.train()
        epoch_loss, steps = 0.0, 0
        for img, label in train_dataloader:
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
            epoch_loss, steps = epoch_loss + train_loss.item(), steps + 1
        logger.info(f"Epoch {epoch} - train loss: {epoch_loss / steps:.5}", ranks=[0])
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    logger.info(f"MyGradientHandler ran {MyGradientHandler.calls} times")
    logger.info(f"parameter checksum {checksum:.12e}")
    gpc.destroy()


if __name__ == "__main__":
    main()
