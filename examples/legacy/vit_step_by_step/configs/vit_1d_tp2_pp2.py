"""The hybrid config of "Step By Step: Accelerate ViT Training" (``vit_1d_tp2_pp2.py``).

Pipeline 2 x 1D tensor parallel 2 on 4 processes (data parallel 1), as on the page. Changed
from the page (ViT-Base, 224x224 images, 300 epochs): the model and batch sizes, for 8x8
digits on a CPU; warm-up epochs in proportion (32 of 300); ``NUM_EPOCHS`` from the
environment; the NAIVE fp16 ``initial_scale`` lowered for runs of a few dozen steps.
"""

import os

from colossalai.amp import AMP_TYPE

# hyper parameters
# BATCH_SIZE is as per GPU
# global batch size = BATCH_SIZE x data parallel size
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.3
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "10"))
WARMUP_EPOCHS = NUM_EPOCHS * 32 // 300

# model config
IMG_SIZE = 8
PATCH_SIZE = 4
IN_CHANS = 1
HIDDEN_SIZE = 64
DEPTH = 4
NUM_HEADS = 4
MLP_RATIO = 2
NUM_CLASSES = 10
CHECKPOINT = True
SEQ_LENGTH = (IMG_SIZE // PATCH_SIZE) ** 2 + 1  # add 1 for cls token

# parallel setting
TENSOR_PARALLEL_SIZE = 2
TENSOR_PARALLEL_MODE = "1d"

parallel = dict(
    pipeline=2,
    tensor=dict(mode=TENSOR_PARALLEL_MODE, size=TENSOR_PARALLEL_SIZE),
)

# pipeline config
NUM_MICRO_BATCHES = parallel["pipeline"]
TENSOR_SHAPE = (BATCH_SIZE // NUM_MICRO_BATCHES, SEQ_LENGTH, HIDDEN_SIZE)

# initial_scale: the default 2**32 takes ~30 overflow-skipped steps to come down, and an
# epoch here is 11 steps (the page's are hundreds)
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)
clip_grad_norm = 1.0
