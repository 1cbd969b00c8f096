"""Policies: how each model family is sharded, as data."""
