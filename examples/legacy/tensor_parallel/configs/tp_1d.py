"""The 1D Tensor Parallelism page's config: 2 processes, tensor mode '1d'."""

parallel = dict(
    data=1,
    pipeline=1,
    tensor=dict(size=2, mode="1d"),
)
