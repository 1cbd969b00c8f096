"""ViT as an ``nn.Sequential`` split by ``build_pipeline_model``, trained with the Trainer.

"Train ViT Using Pipeline Parallelism". Run: ``python3 -m colossal.cli run --nproc_per_node 2
examples/legacy/vit_pipeline/train_vit_pipeline.py``

The page's code with these changes: ``from timm.models import vision_transformer as vit`` ->
``stand_ins.timm_vit`` (the same names, written small); ``vit_large_patch16_224`` -> a small
ViT for 8x8 digits (``vit_tiny_patch4_8``, built by the page's ``sequential_vit``); CIFAR-10
-> digits (``stand_ins.digits``) with ``drop_last=True`` (a batch must split into
``NUM_MICRO_BATCHES``); ``--backend`` defaults to gloo; ``NUM_EPOCHS`` 60 -> 10 (the
environment's ``NUM_EPOCHS`` overrides it); ``--no-progress`` for tests.
"""

import logging
import os
import sys
from collections import OrderedDict
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import colossalai  # noqa: E402
import colossalai.nn as col_nn  # noqa: E402
import stand_ins.timm_vit as vit  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from colossalai.builder import build_pipeline_model  # noqa: E402
from colossalai.logging import disable_existing_loggers, get_dist_logger  # noqa: E402
from colossalai.trainer import Trainer, hooks  # noqa: E402
from colossalai.utils import MultiTimer, get_dataloader  # noqa: E402
from stand_ins.digits import digits_datasets  # noqa: E402


class ViTEmbedding(nn.Module):
    def __init__(
        self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, embed_layer=vit.PatchEmbed,
        drop_rate=0.0, distilled=False,
    ):  # fmt: skip
        super().__init__()
        self.embed_dim = embed_dim  # num_features for consistency with other models
        self.num_tokens = 2 if distilled else 1
        self.patch_embed = embed_layer(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim
        )
        num_patches = self.patch_embed.num_patches

        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + self.num_tokens, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)
        self.init_weights()

    def forward(self, x):
        x = self.patch_embed(x)
        # stole cls_tokens impl from Phil Wang, thanks
        cls_token = self.cls_token.expand(x.shape[0], -1, -1)
        if self.dist_token is None:
            x = torch.cat((cls_token, x), dim=1)
        else:
            x = torch.cat((cls_token, self.dist_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        return x

    def init_weights(self):
        vit.trunc_normal_(self.pos_embed, std=0.02)
        if self.dist_token is not None:
            vit.trunc_normal_(self.dist_token, std=0.02)
        vit.trunc_normal_(self.cls_token, std=0.02)
        self.apply(vit._init_vit_weights)


class ViTHead(nn.Module):
    def __init__(
        self, embed_dim=768, num_classes=1000, norm_layer=None, distilled=False,
        representation_size=None,
    ):  # fmt: skip
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.norm = norm_layer(embed_dim)
        self.num_classes = num_classes
        self.distilled = distilled
        self.num_features = embed_dim
        # Representation layer
        if representation_size and not distilled:
            self.num_features = representation_size
            self.pre_logits = nn.Sequential(
                OrderedDict([("fc", nn.Linear(embed_dim, representation_size)), ("act", nn.Tanh())])
            )
        else:
            self.pre_logits = nn.Identity()
        # Classifier head(s)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    def forward(self, x):
        x = self.norm(x)
        if self.distilled:
            x, x_dist = self.head(x[:, 0]), self.head_dist(x[:, 1])
            if self.training and not torch.jit.is_scripting():
                # during inference, return the average of both classifier predictions
                return x, x_dist
            else:
                return (x + x_dist) / 2
        else:
            x = self.pre_logits(x[:, 0])
            x = self.head(x)
        return x

    def init_weights(self):
        self.apply(vit._init_vit_weights)


def sequential_vit(
    img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768, depth=12,
    num_heads=12, mlp_ratio=4.0, qkv_bias=True, representation_size=None, distilled=False,
    drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, embed_layer=vit.PatchEmbed,
    norm_layer=None, act_layer=None,
):  # fmt: skip
    norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
    act_layer = act_layer or nn.GELU
    embedding = ViTEmbedding(
        img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
        embed_layer=embed_layer, drop_rate=drop_rate, distilled=distilled,
    )  # fmt: skip
    dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth)]  # stochastic depth decay
    blocks = [
        vit.Block(
            dim=embed_dim,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            drop=drop_rate,
            attn_drop=attn_drop_rate,
            drop_path=dpr[i],
            norm_layer=norm_layer,
            act_layer=act_layer,
        )
        for i in range(depth)
    ]
    for block in blocks:
        block.apply(vit._init_vit_weights)
    head = ViTHead(
        embed_dim=embed_dim, num_classes=num_classes, norm_layer=norm_layer, distilled=distilled,
        representation_size=representation_size,
    )  # fmt: skip
    return nn.Sequential(embedding, *blocks, head)


def vit_tiny_patch4_8(**kwargs):
    """The page's ``vit_large_patch16_224`` at the digits' size (1024 wide, 24 deep there)."""
    model_kwargs = dict(
        img_size=8, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=4,
        num_heads=4, mlp_ratio=2.0, **kwargs,
    )  # fmt: skip
    return sequential_vit(**model_kwargs)


def build_digits(batch_size):
    """The page's ``build_cifar(batch_size)`` on the digits."""
    train_dataset, test_dataset = digits_datasets()
    train_dataloader = get_dataloader(
        dataset=train_dataset, shuffle=True, batch_size=batch_size, pin_memory=True,
        drop_last=True,
    )  # fmt: skip
    test_dataloader = get_dataloader(
        dataset=test_dataset, batch_size=batch_size, pin_memory=True, drop_last=True
    )
    return train_dataloader, test_dataloader


BATCH_SIZE = 32
NUM_EPOCHS = int(os.environ.get("NUM_EPOCHS", "10"))
NUM_CHUNKS = 1
CONFIG = dict(NUM_MICRO_BATCHES=4, parallel=dict(pipeline=2))


def train():
    # ColossalAI's logger printed by itself; ours prints where the script configures output.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)

    disable_existing_loggers()
    parser = colossalai.get_default_parser()
    parser.set_defaults(backend="gloo")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    colossalai.launch_from_torch(backend=args.backend, config=CONFIG)
    logger = get_dist_logger()

    # build model
    model = vit_tiny_patch4_8()
    model = build_pipeline_model(model, num_chunks=NUM_CHUNKS, verbose=True)

    # build criterion
    criterion = nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, weight_decay=0)

    # build dataloader
    train_dataloader, test_dataloader = build_digits(BATCH_SIZE)

    engine, train_dataloader, test_dataloader, _ = colossalai.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    timer = MultiTimer()

    trainer = Trainer(engine=engine, timer=timer, logger=logger)

    hook_list = [
        hooks.LossHook(),
        hooks.AccuracyHook(col_nn.metric.Accuracy()),
        hooks.LogMetricByEpochHook(logger),
    ]

    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=NUM_EPOCHS,
        test_dataloader=test_dataloader,
        test_interval=1,
        hooks=hook_list,
        display_progress=not args.no_progress,
    )


if __name__ == "__main__":
    train()
