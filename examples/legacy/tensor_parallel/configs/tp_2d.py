"""The 2D Tensor Parallelism page's config: 4 processes, tensor mode '2d'."""

parallel = dict(
    data=1,
    pipeline=1,
    tensor=dict(size=4, mode="2d"),
)
