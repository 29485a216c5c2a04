"""ucm-connector: the vLLM-facing side (connector, hashing, block format).

The store layer it builds on lives in ``store_backends``.
"""

__version__ = "0.1.0"
