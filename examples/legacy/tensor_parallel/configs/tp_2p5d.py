"""The 2.5D Tensor Parallelism page's config: 8 processes, tensor mode '2.5d'."""

parallel = dict(
    data=1,
    pipeline=1,
    tensor=dict(size=8, mode="2.5d", depth=2),
)
