"""The chapter, reproduced and checked: each section computes its numbers, renderers show them.

Pure functions returning numbers, one module per concern:

* :mod:`~selfattn.tour.checks`: sections 1, 2, 4 and 6 (the chapter's cells, permutation,
  the table P, the rotation between positions);
* :mod:`~selfattn.tour.comparison`: section 3 (CNN vs RNN vs self-attention, measured), with
  :mod:`~selfattn.tour.paths` (dependency paths read off the operations a layer runs);
* :mod:`~selfattn.tour.qualities`: section 5 (what an absolute encoding needs);
* :mod:`~selfattn.tour.taylor`, :mod:`~selfattn.tour.embedding`, :mod:`~selfattn.tour.frameworks`: the
  study note's questions and the MXNet / TensorFlow / Paddle recipes;
* :mod:`~selfattn.tour.family`: section 7 (every encoding of :mod:`selfattn.positional`);
* :mod:`~selfattn.tour.depth`: section 8 (deep stacks, with and without residuals).

:mod:`~selfattn.tour.claims` sets every claim of the five source pages beside its measurement.
Rendering is separate: :mod:`~selfattn.tour.figures` (matplotlib), :mod:`~selfattn.tour.report`
(HTML from jinja2 templates) and :mod:`~selfattn.tour.summary` (the terminal, with rich);
:func:`selfattn.tour.runner.run_tour` ties them together.
"""
