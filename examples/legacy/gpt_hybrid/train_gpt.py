"""GPT split over pipeline stages by hand, with tied embeddings, trained with the Trainer.

"Train GPT Using Hybrid Parallelism". Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/gpt_hybrid/train_gpt.py`` (the page's "only pipeline parallel" config;
``NUM_CHUNKS=2`` in the environment for the interleaved schedule, two model chunks per
stage), or with ``TENSOR_PARALLEL=1d`` on 4 processes for the page's "pipeline + 1D model
parallel" config (pipeline 2 x 1D tensor parallel 2: the model zoo's GPT is built of
``colossalai.nn`` layers, which take the config's mode).

The page's code with these changes: the web-text dataset (a download and GPT-2's tokenizer)
-> synthetic token sequences with the same ``({'input_ids', 'attention_mask'}, input_ids)``
items (:class:`SyntheticTextDataset`); GPT-2 XL (48 layers, 1600 wide) -> 4 layers, 64 wide,
a 64-token vocabulary (``GPT2_tiny_pipeline_hybrid``); sizes and ``NUM_EPOCHS`` for a CPU
(the environment's ``NUM_EPOCHS``, ``NUM_CHUNKS`` and ``TENSOR_PARALLEL`` override them);
the default device the accelerator's instead of ``'cuda'``; ``--backend`` defaults to gloo;
``--no-progress`` for tests; ``NUM_MICRO_BATCHES`` 4 instead of 192 (the page's batch of 192
sequences does not fit a CPU run); and the page's ``initial_scale`` (2**32 by default) is
lowered for runs of a few dozen steps.
"""

import logging
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import colossalai.nn as col_nn  # noqa: E402
import colossalai.utils as utils  # noqa: E402
import model_zoo.gpt.gpt as col_gpt  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from colossalai.amp import AMP_TYPE  # noqa: E402
from colossalai.builder.pipeline import partition_uniform  # noqa: E402
from colossalai.context.parallel_mode import ParallelMode  # noqa: E402
from colossalai.core import global_context as gpc  # noqa: E402
from colossalai.logging import disable_existing_loggers, get_dist_logger  # noqa: E402
from colossalai.nn.layer.wrapper import PipelineSharedModuleWrapper  # noqa: E402
from colossalai.trainer import Trainer, hooks  # noqa: E402
from colossalai.utils.timer import MultiTimer  # noqa: E402
from model_zoo.gpt import GPTLMLoss  # noqa: E402
from torch.nn import functional as F  # noqa: E402, N812
from torch.utils.data import Dataset  # noqa: E402


class PipelineGPTHybrid(nn.Module):
    def __init__(
        self,
        num_layers: int = 12,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        vocab_size: int = 50304,
        embed_drop_rate: float = 0.0,
        act_func: Callable = F.gelu,
        mlp_ratio: int = 4,
        attn_drop_rate: float = 0.0,
        drop_rate: float = 0.0,
        dtype: torch.dtype = torch.float,
        checkpoint: bool = False,
        max_position_embeddings: int = 1024,
        layer_norm_epsilon: float = 1e-5,
        first: bool = False,
        last: bool = False,
    ):
        super().__init__()
        self.embedding = None
        self.norm = None
        self.head = None
        if first:
            self.embedding = col_gpt.GPTEmbedding(
                hidden_size, vocab_size, max_position_embeddings, dropout=embed_drop_rate,
                dtype=dtype,
            )  # fmt: skip
        self.blocks = nn.ModuleList(
            [
                col_gpt.GPTBlock(
                    hidden_size,
                    num_attention_heads,
                    mlp_ratio=mlp_ratio,
                    attention_dropout=attn_drop_rate,
                    dropout=drop_rate,
                    dtype=dtype,
                    checkpoint=checkpoint,
                    activation=act_func,
                )
                for _ in range(num_layers)
            ]
        )
        if last:
            self.norm = col_nn.LayerNorm(hidden_size, eps=layer_norm_epsilon, dtype=dtype)
            self.head = col_gpt.GPTLMHead(
                vocab_size=vocab_size, dim=hidden_size, dtype=dtype, bias=False
            )

    def forward(self, hidden_states=None, input_ids=None, attention_mask=None):
        if self.embedding is not None:
            hidden_states = self.embedding(input_ids=input_ids)
        if attention_mask is not None:
            # every stage receives the batch's raw mask (model(stage_output, **data))
            batch_size = hidden_states.shape[0]
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=hidden_states.dtype)  # fp16 compatibility
            attention_mask = (1.0 - attention_mask) * -10000.0
        for block in self.blocks:
            hidden_states, attention_mask = block(hidden_states, attention_mask)
        if self.norm is not None:
            hidden_states = self.head(self.norm(hidden_states))
        return hidden_states


def build_gpt_pipeline(num_layers, num_chunks, device=None, **kwargs):
    device = device or utils.get_current_device()  # torch.device('cuda') on the page
    logger = get_dist_logger()
    pipeline_size = gpc.get_world_size(ParallelMode.PIPELINE)
    pipeline_rank = gpc.get_local_rank(ParallelMode.PIPELINE)
    rank = gpc.get_global_rank()
    wrapper = PipelineSharedModuleWrapper([0, pipeline_size - 1])
    parts = partition_uniform(num_layers, pipeline_size, num_chunks)[pipeline_rank]
    models = []
    for start, end in parts:
        kwargs["num_layers"] = end - start
        kwargs["first"] = start == 0
        kwargs["last"] = end == num_layers
        logger.info(f"Rank{rank} build layer {start}-{end}, {end - start}/{num_layers} layers")
        chunk = PipelineGPTHybrid(**kwargs).to(device)
        if start == 0:
            wrapper.register_module(chunk.embedding.word_embeddings)
        elif end == num_layers:
            wrapper.register_module(chunk.head)
        models.append(chunk)
    if len(models) == 1:
        model = models[0]
    else:
        model = nn.ModuleList(models)
    return model


VOCAB_SIZE = 64


def GPT2_tiny_pipeline_hybrid(num_chunks=1, checkpoint=False, dtype=torch.float):  # noqa: N802
    """The page's ``GPT2_exlarge_pipeline_hybrid`` (48 layers, 1600 wide) at a CPU's size."""
    cfg = dict(
        hidden_size=64, num_attention_heads=4, vocab_size=VOCAB_SIZE,
        max_position_embeddings=SEQ_LEN, checkpoint=checkpoint, dtype=dtype,
    )  # fmt: skip
    return build_gpt_pipeline(4, num_chunks, **cfg)


class SyntheticTextDataset(Dataset):
    """Token sequences that count up modulo the vocabulary in steps of 1, 2, 3 or 5.

    Stands in for the page's ``WebtextDataset`` (same items: ``({'input_ids',
    'attention_mask'}, input_ids)``): the first token and the step are random, so after two
    tokens the rest of a sequence is predictable, and a model that learns shows it in its loss.
    """

    def __init__(self, num_samples=256, seq_len=1024, vocab_size=VOCAB_SIZE, seed=0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (num_samples, 1), generator=generator)
        steps = torch.tensor([1, 2, 3, 5])[torch.randint(4, (num_samples, 1), generator=generator)]
        self.data = (start + steps * torch.arange(seq_len)) % vocab_size
        self.attention_mask = torch.ones_like(self.data)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return {
            "input_ids": self.data[index],
            "attention_mask": self.attention_mask[index],
        }, self.data[index]


NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "6"))
SEQ_LEN = 16
BATCH_SIZE = 16
NUM_CHUNKS = int(os.environ["NUM_CHUNKS"]) if os.environ.get("NUM_CHUNKS") else None
TENSOR_PARALLEL = os.environ.get("TENSOR_PARALLEL") or None  # '1d': the hybrid config
TENSOR_SHAPE = (BATCH_SIZE // 4, SEQ_LEN, 64)  # (1, 1024, 1600) on the page; unused there too

if TENSOR_PARALLEL is None:
    # only pipeline parallel
    CONFIG = dict(
        NUM_MICRO_BATCHES=4,
        parallel=dict(pipeline=2),
        fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16),
    )
else:
    # pipeline + 1D model parallel
    CONFIG = dict(
        NUM_MICRO_BATCHES=4,
        parallel=dict(pipeline=2, tensor=dict(mode=TENSOR_PARALLEL, size=2)),
        fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16),
    )
if NUM_CHUNKS is not None:  # initialize picks the interleaved schedule from model.num_chunks
    CONFIG["model"] = dict(num_chunks=NUM_CHUNKS)


def train():
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    disable_existing_loggers()
    parser = colossalai.get_default_parser()
    parser.set_defaults(backend="gloo")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    colossalai.launch_from_torch(config=CONFIG, backend=args.backend)
    logger = get_dist_logger()

    train_ds = SyntheticTextDataset(seq_len=SEQ_LEN)  # WebtextDataset(os.environ['DATA'], ...)
    train_dataloader = utils.get_dataloader(
        train_ds, seed=42, batch_size=BATCH_SIZE, pin_memory=True, shuffle=True, drop_last=True
    )

    use_interleaved = NUM_CHUNKS is not None
    num_chunks = 1 if not use_interleaved else NUM_CHUNKS
    model = GPT2_tiny_pipeline_hybrid(num_chunks=num_chunks, checkpoint=True, dtype=torch.half)
    if use_interleaved and not isinstance(model, nn.ModuleList):
        model = nn.ModuleList([model])

    criterion = GPTLMLoss()

    # lr 1.5e-4 on the page, for GPT-2 XL and batches of 192
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)

    engine, train_dataloader, _, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader=train_dataloader
    )
    global_batch_size = (
        BATCH_SIZE
        * gpc.get_world_size(ParallelMode.DATA)
        * getattr(gpc.config, "gradient_accumulation", 1)
    )
    logger.info(f"Init done, global batch size = {global_batch_size}", ranks=[0])

    timer = MultiTimer()

    trainer = Trainer(engine=engine, logger=logger, timer=timer)

    hook_list = [
        hooks.LossHook(),
        hooks.LogMetricByEpochHook(logger),
        hooks.ThroughputHook(),
        hooks.LogMetricByStepHook(),
    ]

    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=NUM_EPOCHS,
        test_interval=1,
        hooks=hook_list,
        display_progress=not args.no_progress,
        return_output_label=False,
    )


if __name__ == "__main__":
    train()
