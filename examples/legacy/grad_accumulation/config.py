"""Config of "Gradient Accumulation": the parameters are updated every 4 iterations."""

import os

BATCH_SIZE = 32
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "4"))

gradient_accumulation = 4
