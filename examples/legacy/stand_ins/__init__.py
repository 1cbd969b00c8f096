"""What the config-era tutorials download or import from elsewhere, small and offline.

- :mod:`stand_ins.digits`: scikit-learn's bundled digits in place of CIFAR-10, Caltech101 and
  ImageNet (nothing is downloaded).
- :mod:`stand_ins.resnet`: a small ResNet with torchvision's layout (``conv1``, ``bn1``,
  ``relu``, ``maxpool``, ``layer1``..``layer4``, ``avgpool``, ``fc``) in place of
  ``torchvision.models.resnet34``/``resnet50`` (torchvision is not a dependency).
- :mod:`stand_ins.timm_vit`: the parts of ``timm.models.vision_transformer`` the ViT pages use
  (``PatchEmbed``, ``Block``, ``trunc_normal_``, ``_init_vit_weights``, ``VisionTransformer``).

Each tutorial script puts ``examples/legacy`` on ``sys.path`` to import them (and the
``model_zoo`` package, ColossalAI's model zoo the tutorials import from).
"""
