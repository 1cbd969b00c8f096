"""Parallel layers: differentiable primitives, functional ops, modules."""
