"""Config of "Gradient Handler": the engine calls MyGradientHandler instead of using DDP."""

import os

BATCH_SIZE = 32
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "4"))

gradient_handler = [dict(type="MyGradientHandler")]
