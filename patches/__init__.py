"""Every monkey patch of vLLM lives in this package, and nowhere else.

The sparse-attention patches arrive with the sparse-attention work; until
then this package patches nothing.
"""
