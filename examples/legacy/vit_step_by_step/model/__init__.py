"""The page's ``hybrid_parallel/model`` package: the pipeline ViT builder."""
