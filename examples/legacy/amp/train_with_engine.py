"""Mixed precision through the config ("Auto Mixed Precision Training", steps 2-7).

Run: ``python3 -m colossal.cli run --nproc_per_node 2 examples/legacy/amp/train_with_engine.py
--config examples/legacy/amp/config/config_AMP_torch.py`` (or ``config_AMP_naive.py``)

The page's code with these changes: timm's ``vit_base_patch16_224`` -> a small
``VisionTransformer`` with timm's structure (``stand_ins.timm_vit``); Caltech101 (a download)
-> digits (``stand_ins.digits``, gray repeated to RGB as the page's ``Gray2RGB`` does);
``backend='gloo'``; ``enumerate(train_dataloader)`` -> ``train_dataloader`` (the page's loop
would unpack ``(index, batch)``); SGD ``lr=1e-2, weight_decay=0.1`` -> ``lr=0.05,
momentum=0.9, weight_decay=1e-4`` (the page's barely moves in the few dozen steps here);
the epoch's mean loss logged on rank 0 (the page logs nothing).
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import torch  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import get_dist_logger  # noqa: E402
from colossalai.nn.lr_scheduler import LinearWarmupLR  # noqa: E402
from colossalai.utils import get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402
from stand_ins.timm_vit import VisionTransformer  # noqa: E402


def main() -> None:
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    # initialize distributed setting
    parser = colossalai.get_default_parser()
    args = parser.parse_args()

    # launch from torch
    colossalai.launch_from_torch(config=args.config, backend="gloo")
    logger = get_dist_logger()

    # build model
    model = VisionTransformer(  # vit_base_patch16_224(drop_rate=0.1) on the page
        img_size=8, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=2,
        num_heads=4, mlp_ratio=2, drop_rate=gpc.config.DROP_RATE,
    )  # fmt: skip

    # build dataloader
    train_dataset, _ = digits_datasets(channels=3)
    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=gpc.config.BATCH_SIZE,
        num_workers=1,
        pin_memory=True,
    )

    # build optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    # build loss
    criterion = torch.nn.CrossEntropyLoss()

    # lr_scheduler (50 warm-up epochs of 300 on the page)
    lr_scheduler = LinearWarmupLR(
        optimizer, warmup_steps=gpc.config.NUM_EPOCHS // 6, total_steps=gpc.config.NUM_EPOCHS
    )

    # inject the AMP feature
    engine, train_dataloader, _, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader
    )
    logger.info(f"model {type(engine.model).__name__}", ranks=[0])

    # train with the engine
    engine.train()
    for epoch in range(gpc.config.NUM_EPOCHS):
        epoch_loss, steps = 0.0, 0
        for img, label in train_dataloader:
            engine.zero_grad()
            output = engine(img)
            loss = engine.criterion(output, label)
            engine.backward(loss)
            engine.step()
            epoch_loss, steps = epoch_loss + loss.item(), steps + 1
        lr_scheduler.step()
        logger.info(f"Epoch {epoch} - train loss: {epoch_loss / steps:.5}", ranks=[0])
    gpc.destroy()


if __name__ == "__main__":
    main()
