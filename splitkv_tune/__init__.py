"""splitkv-tune: a split-KV FlashAttention forward kernel and the tools that tune it."""
from splitkv_tune.tunables import Config, Shape

__version__ = "0.1.0"


def __getattr__(name):
    # Importing torch is slow; only pay for it when the attention entry point is used.
    if name in ("splitkv_attention", "workspace_size"):
        from splitkv_tune import ops
        return getattr(ops, name)
    raise AttributeError(name)


__all__ = ["Config", "Shape", "splitkv_attention", "workspace_size", "__version__"]
