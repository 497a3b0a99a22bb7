"""The chapter, reproduced and checked: each section computes its numbers, renderers show them."""
