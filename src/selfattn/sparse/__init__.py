"""DeepSeek sparse attention (DSA): the layer, the lightning indexer that picks each query's keys, and the caches.

The picks go to attention as :func:`selfattn.masks.selected` (or
:func:`selfattn.functional.sparse_attention`), where the "sparse selection" route computes only them.
"""

from selfattn.sparse.attention import SparseLatentAttention, SparseLatentCache
from selfattn.sparse.cache import IndexerKeyCache
from selfattn.sparse.indexer import LightningIndexer, select_top_k

__all__ = ["IndexerKeyCache", "LightningIndexer", "SparseLatentAttention", "SparseLatentCache", "select_top_k"]
