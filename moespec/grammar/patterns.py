"""The `pattern` shapes xgrammar 0.2.9 compiles loosely inside a JSON schema.

xgrammar turns a schema's `pattern` into a JSON-string regex of its own (not the one behind
`Grammar.from_regex`, which gets these right). Its repetition is loose in two shapes, found by
comparing it with Python's `re` over every short string of random patterns
(tests/test_structured_backends.py keeps real ones):

- an optional group `( ... )?` of several items whose last item repeats a varying number of
  times, or whose first item repeats without bound: `(\\.[0-9]{1,4})?` accepts `0` (the dot is
  skipped), `(\\.p\\d+)?` after `GRCh37` accepts `GRCh375`, `(b+x)?` accepts `b`; a single
  item that repeats at least twice a varying number of times, `(a{2,})?`, is loose too;
- a counted repetition (`{0,2}`) of such a group (`([ab]?(a|a{1,2})){0,2}`);
- a varying repetition nested in one that repeats at least twice a varying number of times
  (`(a[ab]*b{1,2}|a?){2,}`), or in any varying repetition when it repeats at least twice
  itself.

These rules were fitted to the loose cases found and are wider than the bug (`(xb{1,2}){1,2}`
is compiled exactly but refused). `(x[0-9]{2})?`, `(ab?)?`, `(ab+)*` and `(ab+)+` are
compiled exactly and served.
"""
from __future__ import annotations

import re
import warnings
from re import _constants as C  # noqa: PLC2701  the parse tree of Python's own re
from re import _parser as parser  # noqa: PLC2701

REPEATS = (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT)
UNICODE_CLASS = re.compile(r"(?<!\\)((?:\\\\)*)\\[pP]\{\w+\}")  # \p{L}: one character to re's parser


def loose_in_xgrammar(pattern: str) -> str | None:
    """Why xgrammar would compile `pattern` loosely, or None. Also None where Python's re cannot
    parse it (syntax of other dialects besides `\\p{..}`): such a pattern is not checked."""
    try:
        with warnings.catch_warnings():  # re's FutureWarnings on `[[` and `--` in classes
            warnings.simplefilter("ignore")
            items = parser.parse(UNICODE_CLASS.sub(r"\1a", pattern))
    except (parser.error, RecursionError, OverflowError):
        return None
    return loose_items(list(items))


def varies(lo: int, hi: int) -> bool:
    """A repetition of a varying count other than `?`."""
    return lo != hi and (lo, hi) != (0, 1)


def loose_items(items: list) -> str | None:
    for op, av in items:
        if op in REPEATS:
            lo, hi, body = av
            if (lo, hi) == (0, 1) and any(loose_optional(seq) for seq in sequences(list(body))):
                return "an optional group that starts or ends with a repetition"
            if varies(lo, hi) and hi != C.MAXREPEAT and any(loose_optional(seq) for seq in sequences(list(body))):
                return "a counted repetition of a group that starts or ends with a repetition"
            if varies(lo, hi) and (repeats_twice(body) if lo < 2 else repeats(body)):
                return "a varying repetition inside another"
            found = loose_items(list(body))
        else:
            found = next(filter(None, map(loose_items, inner(op, av))), None)
        if found:
            return found
    return None


def inner(op, av) -> list[list]:
    """The item lists inside a group, alternation or lookaround."""
    if op is C.SUBPATTERN:
        return [list(av[-1])]
    if op is C.BRANCH:
        return [list(b) for b in av[1]]
    if op in (C.ASSERT, C.ASSERT_NOT):
        return [list(av[1])]
    return []


def sequences(items: list):
    """The item sequences an optional group's body can be (through single groups and alternations)."""
    while len(items) == 1 and items[0][0] is C.SUBPATTERN:
        items = list(items[0][1][-1])
    if len(items) == 1 and items[0][0] is C.BRANCH:
        for branch in items[0][1][1]:
            yield from sequences(list(branch))
    else:
        yield items


def loose_optional(seq: list) -> bool:
    """What an optional (or counted) group's body must not be: several items with a repetition
    at an edge, or a repetition of such a body, or one repeated at least twice a varying count."""
    if len(seq) > 1:
        return edge_repeats(seq, last=True) or edge_repeats(seq, last=False)
    if seq and seq[0][0] in REPEATS:
        lo, hi, body = seq[0][1]
        return lo >= 2 and varies(lo, hi) or any(loose_optional(inner) for inner in sequences(list(body)))
    return repeats_twice(seq)


def edge_repeats(items: list, last: bool) -> bool:
    """The last item repeats a varying count, or the first one without bound (or so does the
    first or last item inside it)."""
    if not items:
        return False
    op, av = items[-1] if last else items[0]
    if op in REPEATS:
        return (varies(av[0], av[1]) if last else av[1] == C.MAXREPEAT) or edge_repeats(list(av[2]), last)
    return any(edge_repeats(sub, last) for sub in inner(op, av) if op is not C.ASSERT and op is not C.ASSERT_NOT)


def repeats(items: list) -> bool:
    """Some item repeats a varying count (other than `?`)."""
    return any(op in REPEATS and (varies(av[0], av[1]) or repeats(list(av[2])))
               or op not in REPEATS and any(map(repeats, inner(op, av))) for op, av in items)


def repeats_twice(items: list) -> bool:
    """Some item repeats a varying count, at least twice."""
    return any(op in REPEATS and (av[0] >= 2 and varies(av[0], av[1]) or repeats_twice(list(av[2])))
               or op not in REPEATS and any(map(repeats_twice, inner(op, av))) for op, av in items)
