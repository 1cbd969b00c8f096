"""The data parallel config of "Step By Step: Accelerate ViT Training With Colossal-AI".

Changed from the page (ViT-Base on CIFAR-10, 300 epochs): sizes for a CPU run in seconds;
``gradient_accumulation`` 16 -> 2 (an epoch here is 23 batches); ``NUM_CLASSES``, which the
script reads, added; ``NUM_EPOCHS`` from the environment. ``dali`` is a user key nothing
reads here (there is no DALI data loader on a CPU); it stays to show user keys pass through.
"""

import os

from colossalai.amp import AMP_TYPE

# ViT Base
BATCH_SIZE = 32
DROP_RATE = 0.1
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "10"))
NUM_CLASSES = 10

# mix precision
fp16 = dict(
    mode=AMP_TYPE.TORCH,
)

gradient_accumulation = 2
clip_grad_norm = 1.0

dali = dict(
    gpu_aug=True,
    mixup_alpha=0.2,
)
