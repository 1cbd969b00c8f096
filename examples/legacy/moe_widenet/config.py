"""Config of "Integrate Mixture-of-Experts Into Your Model" (WideNet on the digits).

``parallel = dict(moe=dict(size=MOE_MODEL_PARALLEL_SIZE))`` as on the page: on 4 processes
the MoE model-parallel groups are {0, 1} and {2, 3} (each rank holds 2 of the 4 experts) and
the MoE data-parallel groups {0, 2} and {1, 3}. Changed from the example (ImageNet WideNet):
a tiny model for 8x8 digits on a CPU, ``NUM_EPOCHS`` from the environment.
"""

import os

BATCH_SIZE = 16  # per process
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.05
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "10"))

# model config
IMG_SIZE = 8
PATCH_SIZE = 2
HIDDEN_SIZE = 32
D_FF = 64
DEPTH = 4
NUM_HEADS = 4
NUM_EXPERTS = 4
CAPACITY_FACTOR = 1.2
NUM_CLASSES = 10

MOE_MODEL_PARALLEL_SIZE = 2
parallel = dict(moe=dict(size=MOE_MODEL_PARALLEL_SIZE))
