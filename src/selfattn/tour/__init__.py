"""The chapter, reproduced and checked: each section computes its numbers, renderers show them.

Pure functions returning numbers, one module per concern:

* :mod:`~selfattn.tour.checks`: sections 1, 2, 4 and 6 (the chapter's cells, permutation,
  the table P, the rotation between positions);
* :mod:`~selfattn.tour.comparison`: section 3 (CNN vs RNN vs self-attention, measured);
* :mod:`~selfattn.tour.qualities`: section 5 (what an absolute encoding needs);
* :mod:`~selfattn.tour.family`: section 7 (every encoding of :mod:`selfattn.positional`);
* :mod:`~selfattn.tour.depth`: section 8 (deep stacks, with and without residuals).

Rendering is separate: :mod:`~selfattn.tour.figures` (matplotlib) and
:mod:`~selfattn.tour.report` (HTML); :func:`selfattn.tour.runner.run_tour` ties them together.
"""
