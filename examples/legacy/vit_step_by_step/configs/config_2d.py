"""A 2D tensor parallel config for the ViT of "Step By Step: Accelerate ViT Training".

The page's hybrid configs name ``tensor=dict(size=..., mode=...)``; this one runs the ViT of
``colossalai.nn`` layers on 4 processes in mode '2d' (data parallel 1: every rank reads
the same batch, the layers keep their part of it). Sizes as in the pipeline config, fp32,
no activation checkpointing; gradient clipping by the one norm over the sharded parameters.
"""

import os

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
CHECKPOINT = False

parallel = dict(
    pipeline=1,
    tensor=dict(size=4, mode="2d"),
)

clip_grad_norm = 1.0
