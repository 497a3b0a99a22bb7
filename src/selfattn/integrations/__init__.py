"""Adapters that plug selfattn into other libraries (imported on demand: each needs its library)."""

__all__: list[str] = []
