"""Config of "Gradient Clipping": the gradients' total norm is clipped to 1.0."""

import os

BATCH_SIZE = 32
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "4"))
LEARNING_RATE = 0.05

clip_grad_norm = 1.0
