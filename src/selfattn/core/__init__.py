"""The attention core: one description of a call, its routes, and the one place that chooses among them.

* :mod:`selfattn.masks` says which keys each query may see (the only place that rule is written).
* :class:`~selfattn.core.call.AttentionCall` describes a call: heads, positions, visibility,
  score term, dropout, and what the caller wants back.
* :mod:`selfattn.core.routes` holds one file per way of computing attention, each with a pure
  ``declines(call)`` (why not, or None) and ``run(call)``.
* :mod:`selfattn.core.dispatch` tries the routes in one ordered list and runs the first that
  does not decline; :func:`~selfattn.core.dispatch.explain` says why each one before it declined.
"""
