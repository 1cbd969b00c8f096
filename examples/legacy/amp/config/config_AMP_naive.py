"""The page's naive AMP config: an fp16 model with fp32 master weights in the optimizer.

The page's defaults spelled out, except ``initial_scale`` (2**32 there), which needs ~30
overflow-skipped steps to come down: a run here is a few dozen steps. Sizes and
``NUM_EPOCHS`` as in ``config_AMP_torch.py``.
"""

import os

from colossalai.amp import AMP_TYPE

BATCH_SIZE = 64
DROP_RATE = 0.1
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "6"))

fp16 = dict(
    mode=AMP_TYPE.NAIVE,
    # below are the default values
    log_num_zeros_in_grad=False,
    initial_scale=2**16,
    min_scale=1,
    growth_factor=2,
    backoff_factor=0.5,
    growth_interval=1000,
    hysteresis=2,
)

clip_grad_norm = 1.0
