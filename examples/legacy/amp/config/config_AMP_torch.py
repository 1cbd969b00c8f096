"""Step 1 of "Auto Mixed Precision Training" (torch AMP): autocast to fp16, fp32 weights.

Changed from the page: sizes and ``NUM_EPOCHS`` (300 there) for a CPU run in seconds.
"""

import os

from colossalai.amp import AMP_TYPE

BATCH_SIZE = 64
DROP_RATE = 0.1
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "6"))

fp16 = dict(
    mode=AMP_TYPE.TORCH,
)

clip_grad_norm = 1.0
