"""Step 5 of "Use Engine and Trainer in Training": train the ResNet with the engine.

Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/resnet_engine_trainer/run_resnet_cifar10_with_engine.py``

The page's loop; ``.cuda()`` dropped, and the logged train loss is the epoch's mean on this
rank (the page logs the last batch's).
"""

import torch
from colossalai.core import global_context as gpc
from common import build_components


def main() -> None:
    engine, train_dataloader, test_dataloader, lr_scheduler, logger = build_components()

    for epoch in range(gpc.config.NUM_EPOCHS):
        # execute a training iteration
        engine.train()
        epoch_loss, steps = 0.0, 0
        for img, label in train_dataloader:
            # set gradients to zero
            engine.zero_grad()

            # run forward pass
            output = engine(img)

            # compute loss value and run backward pass
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)

            # update parameters
            engine.step()
            epoch_loss, steps = epoch_loss + train_loss.item(), steps + 1

        # update learning rate
        lr_scheduler.step()

        # execute a testing iteration
        engine.eval()
        correct = 0
        total = 0
        for img, label in test_dataloader:
            # run prediction without back-propagation
            with torch.no_grad():
                output = engine(img)
                test_loss = engine.criterion(output, label)

            # compute the number of correct prediction
            pred = torch.argmax(output, dim=-1)
            correct += torch.sum(pred == label)
            total += img.size(0)

        logger.info(
            f"Epoch {epoch} - train loss: {epoch_loss / steps:.5}, test loss: {test_loss:.5}, "
            f"acc: {correct / total:.5}, lr: {lr_scheduler.get_last_lr()[0]:.5g}",
            ranks=[0],
        )
    gpc.destroy()


if __name__ == "__main__":
    main()
