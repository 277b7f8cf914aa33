"""The compute data plane: real torch models on the engine's paged KV, across ranks.

Unlike the rest of `labkit.engine`, this package imports torch.
"""
