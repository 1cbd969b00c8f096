"""A small stand-in for ColossalAI's ``model_zoo`` (the models its tutorials import).

ColossalAI-Examples shipped ``model_zoo/`` next to the tutorial scripts; they import
``model_zoo.vit.vit`` (``ViTBlock``, ``ViTEmbedding``, ``ViTHead``, ``_create_vit_model``) and
``model_zoo.gpt`` (``GPTEmbedding``, ``GPTBlock``, ``GPTLMHead``, ``GPTLMLoss``). These have
the same names and arguments, built from ``torch.nn``: ColossalAI's versions are made of its
mode-dispatched tensor-parallel layers (``colossalai.nn.Linear``...), which are not built yet
(see ../README.md), so these models are not split over a tensor-parallel group.
"""
