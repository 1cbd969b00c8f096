"""Train WideNet with MoE ("Integrate Mixture-of-Experts Into Your Model").

Run (4 processes, MoE model-parallel size 2): ``python3 -m colossal.cli run
--nproc_per_node 4 examples/legacy/moe_widenet/train_widenet.py``

The page's steps: ``parallel=dict(moe=dict(size=E))`` in the config, ``moe_set_seed`` before
building the model, experts / router / ``MoeLayer`` from ``colossalai.nn.layer.moe``, the
criterion wrapped in ``MoeLoss(aux_weight=0.01, ...)``, and ``colossalai.initialize``, which
adds the ``MoeGradientHandler``. Changed from ColossalAI-Examples' WideNet: the digits
(``stand_ins.digits``) in place of ImageNet, ``backend='gloo'``, the Engine loop of the
other tutorials; rank 0 logs each epoch's mean training loss and the held-out accuracy at
the end.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.context import ParallelMode  # noqa: E402
from colossalai.context.random import moe_set_seed  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.global_variables import moe_env  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.nn.loss import MoeLoss  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from torch import nn  # noqa: E402

from moe_widenet.widenet import Widenet  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.py")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    colossalai.launch_from_torch(config=CONFIG, backend="gloo")
    logger = get_dist_logger()
    logger.info(
        f"moe_env: model parallel size {moe_env.model_parallel_size}, data parallel size "
        f"{moe_env.data_parallel_size}; MOE_MODEL ranks "
        f"{gpc.get_ranks_in_group(ParallelMode.MOE_MODEL)}, MOE_DATA ranks "
        f"{gpc.get_ranks_in_group(ParallelMode.MOE_DATA)}"
    )

    cfg = gpc.config
    moe_set_seed(42)
    model = Widenet(
        num_experts=cfg.NUM_EXPERTS, capacity_factor=cfg.CAPACITY_FACTOR, img_size=cfg.IMG_SIZE,
        patch_size=cfg.PATCH_SIZE, d_model=cfg.HIDDEN_SIZE, d_ff=cfg.D_FF, depth=cfg.DEPTH,
        num_heads=cfg.NUM_HEADS, num_classes=cfg.NUM_CLASSES,
    )  # fmt: skip
    train_dataset, test_dataset = digits_datasets(image_size=cfg.IMG_SIZE)
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=cfg.BATCH_SIZE, drop_last=True
    )
    test_dataloader = get_dataloader(dataset=test_dataset, batch_size=cfg.BATCH_SIZE)
    criterion = MoeLoss(aux_weight=0.01, loss_fn=nn.CrossEntropyLoss, label_smoothing=0.1)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.LEARNING_RATE, weight_decay=cfg.WEIGHT_DECAY
    )
    engine, train_dataloader, test_dataloader, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    handlers = [type(h).__name__ for h in engine._gradient_handlers or []]
    logger.info(f"gradient handlers: {handlers}", ranks=[0])

    for epoch in range(cfg.NUM_EPOCHS):
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

    engine.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for img, label in test_dataloader:
            correct += (engine(img).argmax(dim=-1) == label).sum().item()
            total += label.numel()
        moe_env.reset_loss()
    logger.info(f"test accuracy on rank 0's share: {correct / total:.3f}", ranks=[0])
    gpc.destroy()


if __name__ == "__main__":
    main()
