"""Step 1 of "Use Engine and Trainer in Training": the config file.

``gpc.config.BATCH_SIZE`` and ``gpc.config.NUM_EPOCHS`` are read by the scripts; ``fp16``
tells ``colossalai.initialize`` to train with PyTorch's mixed precision (AMP_TYPE.TORCH).
Changed from the page: 200 epochs -> 10 (``NUM_EPOCHS`` in the environment overrides it).
"""

import os

from colossalai.amp import AMP_TYPE

BATCH_SIZE = 128
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "10"))

fp16 = dict(mode=AMP_TYPE.TORCH)
