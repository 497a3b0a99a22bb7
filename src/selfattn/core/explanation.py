"""What :func:`~selfattn.core.dispatch.explain` returns: the route of a call, in words, for a person.

Each route is named in :data:`ROUTE_NOTES` with what it does and when it is chosen; the docs page
"Routes" (docs/routes.md) says the same at more length, one section per route, and a test checks
that every route of :data:`~selfattn.core.dispatch.ROUTES` has a note and a section.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

__all__ = ["ROUTE_NOTES", "ROUTES_PAGE", "Explanation", "route_anchor"]

#: Where the routes are explained at length (the docs site's page; its sections are the route names).
ROUTES_PAGE = "docs/routes.md"

#: Route name -> (what it computes, in words; when the dispatcher chooses it).
ROUTE_NOTES: dict[str, tuple[str, str]] = {
    "sparse selection": (
        "each query's selected keys gathered and attended alone (DeepSeek sparse attention)",
        "masks.selected picks at most a quarter of the keys per query, with no score term, bias, dropout or weights, "
        "and either at most 64 queries or at least 8 query heads per key/value head",
    ),
    "ragged valid rows": (
        "a ragged batch run group by group on its valid query rows only",
        "a module call with valid_lens alone and skip_padded_queries: padded queries are never computed",
    ),
    "ragged": (
        "a ragged batch: each group of sequences of one valid length attends over its own keys, no mask",
        "a module call of self-attention with valid_lens (and causal) alone",
    ),
    "band only": (
        "a sliding window and nothing else, band by band through PyTorch's fused kernel",
        "the only rule is a window (with causal), on one whole sequence long enough for bands to pay",
    ),
    "banded": (
        "sliding-window attention: each block of queries computes only its band of keys",
        "a window with other rules (documents, padding, a score term) on one whole sequence",
    ),
    "chunks": (
        "chunked attention as one fused call over the batch of chunks",
        "the only rules are chunks (and causal) on a square call that starts a chunk",
    ),
    "prefix": (
        "prefix-LM attention as two fused calls: the prefix among itself, causal attention for the rest",
        "the mask is causal() | prefix(lengths) on a whole sequence",
    ),
    "flex": (
        "the score term's elementwise form inside FlexAttention's compiled kernel",
        "a score term with an elementwise form, on CUDA",
    ),
    "causal key rows": (
        "causal attention with a key-only score term (ALiBi's causal form), chunk by chunk through the flash kernel",
        "causal, and a score term that depends on the key alone",
    ),
    "blockwise key row": (
        "a key-only score term as one row of float mask shared by every query, through the flash kernel",
        "a score term that depends on the key alone (every query sees the same row); off the CPU, a decoding step",
    ),
    "fused sinks": (
        "attention sinks in one call of the flash kernel, corrected by its log-sum-exp",
        "sinks, with no mask beyond the kernel's own causal one",
    ),
    "sliced": (
        "dropout or a softcap computed one (batch, head) slice at a time, in tiles",
        "dropout or a softcap and no score term, on CPU",
    ),
    "blockwise clipped": (
        "Shaw's clipped relative tables applied block by block without gathers",
        "a score term with clipped tables (Shaw et al.), not in a decoding step",
    ),
    "blockwise band": (
        "a relative score term read once as a band that every block of queries shares",
        "a relative score term (it depends on the offset key - query alone), not in a decoding step",
    ),
    "blockwise": (
        "queries in blocks, each computing only the keys its mask lets it reach",
        "a score term (a decoding step's too), dropout, a softcap or sinks, or a mask whose blocks skip most key pairs",
    ),
    "explicit value term": (
        "scores, softmax and weighted sum written out, plus the term's value term (Shaw's values)",
        "the score term adds to the values, which only this route computes",
    ),
    "explicit": (
        "scores, softmax and weighted sum written out, keeping the weights",
        "the weights were asked for (return_weights=True)",
    ),
    "explicit softcap/sinks": (
        "scores written out to apply a softcap or sinks",
        "a softcap or sinks where no blockwise route could take them (compiling, a float bias)",
    ),
    "split keys": (
        "one head's few query rows over many keys cut into chunks the threads share, merged by log-sum-exp",
        "on CPU without grad mode, one query and one key head of equal sizes (absorbed MLA decoding), no bias, "
        "term, dropout or weights, when the fused kernel's work items leave threads idle and the keys fill 2 "
        "chunks of 256",
    ),
    "fused": (
        "PyTorch's fused kernel, scaled_dot_product_attention",
        "the default: no route before it applied",
    ),
}


def route_anchor(route: str) -> str:
    """The heading anchor of ``route`` on the routes page, as Python-Markdown's toc makes it.

    Characters other than letters, digits, ``_``, ``-`` and spaces are dropped, then runs of
    spaces and dashes become one dash: ``"explicit softcap/sinks"`` -> ``"explicit-softcapsinks"``.
    """
    kept = re.sub(r"[^\w\s-]", "", route).strip().lower()
    return re.sub(r"[-\s]+", "-", kept)


@dataclass(frozen=True)
class Explanation:
    """The route a call takes, why, what it costs, and (on request) why each route before it declined.

    ``str()`` gives the route in words, why it was chosen and its cost; the declined routes only
    when ``verbose`` (``explain(..., verbose=True)``, or :meth:`describe` with ``verbose=True``).

    Attributes:
        route: the chosen route's name (see docs/routes.md).
        declined: ``(route name, reason)`` for each route tried before it, in order.
        cost: what the route computes and holds for this call, where known ("" otherwise).
        verbose: whether ``str()`` lists the declined routes.
        parts: the layer's parts, one line each (:meth:`selfattn.MultiHeadAttention.describe_parts`);
            empty for a functional call.
    """

    route: str
    declined: tuple[tuple[str, str], ...]
    cost: str = ""
    verbose: bool = False
    parts: tuple[str, ...] = ()

    def with_parts(self, parts: tuple[str, ...]) -> Explanation:
        """This explanation with the layer's ``parts`` named beside the route."""
        return dataclasses.replace(self, parts=parts)

    def describe(self, verbose: bool | None = None) -> str:
        """The explanation as lines of text; ``verbose`` (default: the field) adds the declined routes."""
        what, when = ROUTE_NOTES.get(self.route, (self.route, ""))
        lines = [f"route: {self.route}: {what}"]
        if when:
            lines.append(f"why: {when}")
        if self.cost:
            lines.append(f"cost: {self.cost}")
        lines.append(f"more: {ROUTES_PAGE}#{route_anchor(self.route)}")
        lines += [f"part: {part}" for part in self.parts]
        if self.verbose if verbose is None else verbose:
            lines.append("declined before it:" if self.declined else "declined before it: none (it is tried first)")
            lines += [f"  {name}: {reason}" for name, reason in self.declined]
        elif self.declined:
            lines.append(f"({len(self.declined)} routes before it declined: .describe(verbose=True) says why)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()
