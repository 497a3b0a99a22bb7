"""DeepSeek sparse attention (DSA): the lightning indexer that picks each query's keys, and its key cache.

The picks go to attention as :func:`selfattn.masks.selected` (or
:func:`selfattn.functional.sparse_attention`), where the "sparse selection" route computes only them.
"""

from selfattn.sparse.cache import IndexerKeyCache
from selfattn.sparse.indexer import LightningIndexer, select_top_k

__all__ = ["IndexerKeyCache", "LightningIndexer", "select_top_k"]
