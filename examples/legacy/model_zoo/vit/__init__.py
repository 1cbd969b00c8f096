"""ColossalAI model zoo's ViT (see :mod:`model_zoo.vit.vit`)."""
