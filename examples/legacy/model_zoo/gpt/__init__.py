"""ColossalAI model zoo's GPT (see :mod:`model_zoo.gpt.gpt`)."""

from model_zoo.gpt.gpt import GPTBlock, GPTEmbedding, GPTLMHead, GPTLMLoss

__all__ = ["GPTBlock", "GPTEmbedding", "GPTLMHead", "GPTLMLoss"]
