"""The routes of attention, one file each; :mod:`selfattn.core.dispatch` orders them."""
