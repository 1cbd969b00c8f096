"""The 3D Tensor Parallelism page's config: 8 processes, tensor mode '3d'."""

parallel = dict(
    data=1,
    pipeline=1,
    tensor=dict(size=8, mode="3d"),
)
