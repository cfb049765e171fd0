"""What one render of a chat template may spend (`Budget`), and the checks the sandbox's hooks make
(`template_sandbox`). No Jinja here: plain values in, InvalidArgumentError out.

A render's limits:
- wall time `MAX_RENDER_S`, checked at every hook (a loop's item, a call, a test, a value built);
- loop items `MAX_LOOP_ITEMS`, recursive loops' inner iterables included;
- units built `MAX_BUILT_UNITS`: a string's characters; a list, tuple or dict built by the template
  counts `SLOT_UNITS` per slot plus what its items count, an item shared by several slots counted in
  each (its *logical* size: `[a, a]` sixty times over is 2^60 items to print, compare or encode, and
  one C call that does so has no hook inside it), and nests at most `MAX_DEPTH` deep (hashing a tuple
  nested 300,000 deep crashed the interpreter);
- an integer argument to a string method or a filter at most `MAX_ARG_INT`, integers in arithmetic at
  most `MAX_INT_BITS` bits, and what a replace, join, indent, wordwrap, expandtabs or format could make
  at most, all refused before the call runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import string
import time

from edgeinfer.errors import InvalidArgumentError

MAX_REPEAT_ITEMS = 1 << 20  # a template's `*` may build a string or list of at most this many items
MAX_INT_BITS = 1 << 12  # an integer in arithmetic (`**`, `*`, `//`, ...): 4,096 bits, 1,233 digits (str() of one
# of 4,300 digits cost 0.2 ms, and a join of 100,000 of them 20 s)
MAX_INT_TEXT = 1024  # characters of a string the int filter reads
MAX_LOOP_ITEMS = 1 << 20  # loop iterations in one render (about a second of Jinja)
MAX_BUILT_UNITS = 64 << 20  # characters, and SLOT_UNITS per container slot, built in one render
SLOT_UNITS = 8  # a container slot's units: a pointer's bytes
MAX_DEPTH = 256  # containers nested in one another (real templates: under 10)
MAX_RENDER_S = 5.0  # one render's wall time (real templates: milliseconds, 40 ms for 6,000 messages)
MAX_ARG_INT = 1 << 20  # an integer given to a string method or a filter (a width, a tab size, an indent)
MAX_JSON_INDENT = 64  # tojson(indent=n): every nested line gets n spaces per level
_CONTAINERS = (list, tuple, dict)


def _refuse(why: str):
    raise InvalidArgumentError(f"chat template: {why}")


class Budget:
    """What one render has left to spend; InvalidArgumentError once a limit is passed."""

    def __init__(self):
        self.loop_items, self.units = MAX_LOOP_ITEMS, MAX_BUILT_UNITS
        self.deadline = time.monotonic() + MAX_RENDER_S
        self._measured: dict[int, tuple[object, int, int]] = {}  # id -> (container kept alive, size, depth)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            _refuse(f"one render ran past {MAX_RENDER_S:g} s")

    def loop(self, iterable):
        for item in iterable:
            self.loop_items -= 1
            if self.loop_items < 0:
                _refuse(f"its loops passed {MAX_LOOP_ITEMS} iterations in one render")
            self.tick()
            yield item

    def room(self, units: int) -> None:
        """Refuse, before it is made, a value of up to `units` that the budget cannot hold."""
        if units > self.units:
            _refuse(f"it would build {units} characters, past the {max(self.units, 0)} left of the "
                    f"{MAX_BUILT_UNITS} one render may build")

    def built(self, value):
        """Count a value the template made (its logical size: `measure`); returns it."""
        self.tick()
        if isinstance(value, (str, bytes, bytearray)):
            used = len(value)
        elif isinstance(value, _CONTAINERS):
            used = self.measure(value)[0]
        else:
            return value
        self.units -= used
        if self.units < 0:
            _refuse(f"it built more than {MAX_BUILT_UNITS} characters in one render")
        return value

    def measure(self, value) -> tuple[int, int]:
        """(logical size, depth) of a container: SLOT_UNITS per slot plus its items', a shared item
        counted in every slot. A container that holds containers is walked once per render (kept alive
        beside its size, so its id stays its own); one that holds none is counted in place (a million
        one-item lists from `batch(1)` would have filled the memo). Refuses past the units left or
        MAX_DEPTH."""
        memo = self._measured
        hit = memo.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1], hit[2]
        if not _holds_containers(value):
            return _leaf_size(value), 0
        stack, seen, big_leaves = [(value, False)], set(), {}

        def leaf_size(x) -> int:  # a long leaf referenced from many slots is sized once ([big] * 10**6)
            if len(x) < 64:
                return _leaf_size(x)
            got = big_leaves.get(id(x))
            if got is None:
                got = big_leaves[id(x)] = _leaf_size(x)
            return got

        while stack:
            node, ready = stack.pop()
            key = id(node)
            if key in memo and memo[key][0] is node:
                continue
            items = _items(node)
            if not ready:
                if key in seen:  # a cycle (not buildable in the sandbox; from an input, say): counted once
                    memo[key] = (node, SLOT_UNITS * len(items), 0)
                    continue
                seen.add(key)
                stack.append((node, True))
                distinct = {id(x): x for x in items if isinstance(x, _CONTAINERS)}.values()
                stack.extend((x, False) for x in distinct if not _known(memo, x) and _holds_containers(x))
                continue
            size, depth = SLOT_UNITS * len(items), 0
            for x in items:
                if isinstance(x, str):
                    size += len(x)
                elif isinstance(x, int):
                    size += _digits(x)
                elif isinstance(x, _CONTAINERS):
                    known = memo.get(id(x))
                    s, d = (known[1], known[2]) if known is not None and known[0] is x else (leaf_size(x), 0)
                    size, depth = size + s, max(depth, d + 1)
                    if size > self.units:  # at once: the walk's work stays within what the budget allows
                        self.room(size)  # ([big] * 10**6 would size big a million times)
            if depth > MAX_DEPTH:
                _refuse(f"it nests values more than {MAX_DEPTH} deep")
            self.room(size)
            memo[key] = (node, size, depth)
        return memo[id(value)][1:]


def _known(memo: dict, x) -> bool:
    got = memo.get(id(x))
    return got is not None and got[0] is x


def _items(node) -> list:
    return [*node.keys(), *node.values()] if isinstance(node, dict) else node


def _holds_containers(node) -> bool:
    return any(isinstance(x, _CONTAINERS) for x in _items(node))


def _leaf_size(node) -> int:
    """A container of no containers: SLOT_UNITS a slot plus its strings' characters and its big
    integers' digits (what str() of it writes)."""
    items = _items(node)
    return SLOT_UNITS * len(items) + sum(len(x) if isinstance(x, str) else _digits(x) if isinstance(x, int) else 0
                                         for x in items)


def _digits(x: int) -> int:
    """About the digits of a big integer (none counted under 64 bits: they are cheap)."""
    bits = x.bit_length()
    return bits // 3 if bits > 64 else 0


_BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("edgeinfer_template_budget")


@contextlib.contextmanager
def budget():
    """A fresh Budget for the renders inside (one render: `ChatTemplate.render`)."""
    token = _BUDGET.set(Budget())
    try:
        yield
    finally:
        _BUDGET.reset(token)


def current() -> Budget:
    b = _BUDGET.get(None)
    if b is None:  # (also at compile time: a hook then refuses to be folded into a constant)
        raise RuntimeError("a chat template renders inside template_budget.budget() (ChatTemplate.render)")
    return b


def check_int_op(operator: str, left, right) -> None:
    """Arithmetic on integers past MAX_INT_BITS (a 4M-hex-digit `|int(base=16)` divided: minutes in
    one C call), and `**` whose result would be."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if operator == "**" and right > 0 and max(left.bit_length(), 1) * right > MAX_INT_BITS:
        _refuse(f"an integer of {left.bit_length()} bits ** {right} is too large")  # (str() of it may be refused)
    if max(left.bit_length(), right.bit_length()) > MAX_INT_BITS:
        _refuse(f"an integer of {max(left.bit_length(), right.bit_length())} bits in arithmetic is past "
                f"{MAX_INT_BITS}")


def check_repeat(left, right) -> None:
    if isinstance(left, int) and isinstance(right, (str, list, tuple)):
        left, right = right, left
    if isinstance(left, (str, list, tuple)) and isinstance(right, int) and len(left) * right > MAX_REPEAT_ITEMS:
        _refuse(f"repeating {len(left)} items {right} times is too many")


def text_bound(x) -> int:
    """The most characters str(x) can make: a string's length, an integer's digits, a container's
    logical size (`Budget.measure`), 64 for anything else (a float's repr is at most 24)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, int):
        return x.bit_length() // 3 + 2
    if isinstance(x, _CONTAINERS):
        return current().measure(x)[0]
    return 64


_PERCENT = re.compile(r"%(?:\((?P<key>[^)]*)\))?[-#0 +]*(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d+))?[hlL]?(?P<conv>[a-zA-Z%])")


def check_percent(fmt, args=None) -> None:
    """`fmt % args` (the `%` operator and the format filter): a width or precision taken from an
    argument (`*`) is refused; the most it can make (each conversion's width, precision and argument
    text, an argument used 2,000 times counted 2,000 times) must fit the budget."""
    if not isinstance(fmt, str):
        return
    positional = list(args) if isinstance(args, tuple) else [args]
    total, i = len(fmt), 0
    for m in _PERCENT.finditer(fmt):
        if m["width"] == "*" or m["prec"] == "*":
            _refuse(f"the format {fmt[:40]!r} takes a width from an argument")
        if m["conv"] == "%":
            continue
        total += int(m["width"] or 0) + int(m["prec"] or 0)
        if m["key"] is not None:
            value = args.get(m["key"]) if isinstance(args, dict) else None
        else:
            value, i = (positional[i] if i < len(positional) else None), i + 1
        total += text_bound(value) if value is not None else 0
    current().room(total)


def check_format(fmt: str, args: tuple = (), kwargs: dict | None = None) -> None:
    """`fmt.format(*args, **kwargs)`: a width taken from an argument is refused; the most it can make
    (widths, precisions, and each field's argument text, once per use) must fit the budget
    ('{0}' * 2000 of a 1 MB string: 2 GB; 4-digit widths with a 4-byte fill 100,000 times: 4 GB)."""
    kwargs = kwargs or {}
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format will refuse it
    total, auto = len(fmt), 0
    for _, name, spec, _ in fields:
        if name is None:
            continue
        if spec and "{" in spec:
            _refuse(f"the format {fmt[:40]!r} takes its width from an argument")
        m = re.match(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?", spec or "")
        total += (int(m[1]) if m and m[1] else 0) + (int(m[2]) if m and m[2] else 0)
        head = re.split(r"[.\[]", name, maxsplit=1)[0]
        if head == "":
            head, auto = str(auto), auto + 1
        value = args[int(head)] if head.isdigit() and int(head) < len(args) else kwargs.get(head)
        total += text_bound(value) if value is not None else 0
    current().room(total)


ATTRIBUTE_FILTERS = frozenset({"map", "sort", "unique", "groupby", "min", "max", "sum", "selectattr", "rejectattr",
                               "attr", "dictsort"})
MAX_ATTRIBUTE_PARTS = 16  # `attribute='a.b.c'`: one lookup a part an item (5,001 parts on 100,000 items: 16 s)


def check_args(what: str, value, args: tuple, kwargs: dict) -> None:
    """Before a string method or a filter `what` runs on `value`: no integer argument past MAX_ARG_INT
    (`'x'.center(10**9)` took 1 GB before its result could be counted), and for those that can make
    far more than they are given, room for the most they can make."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARG_INT:
            _refuse(f"{what}(an integer of {a.bit_length()} bits) is past the {MAX_ARG_INT} a template may ask")
        if what in ATTRIBUTE_FILTERS and isinstance(a, str) and a.count(".") >= MAX_ATTRIBUTE_PARTS:
            _refuse(f"{what} with an attribute path of {a.count('.') + 1} parts")
    arg = (lambda i, key, default=None: args[i] if len(args) > i else kwargs.get(key, default))
    if what == "join":  # value: the items (a list, a string: its characters); the separator the argument
        sep = arg(0, "d", "")
        if isinstance(value, str):
            current().room(len(value) * (1 + len(str(sep))))
        elif isinstance(value, (list, tuple)):
            current().room(len(str(sep)) * len(value) + sum(map(text_bound, value)))
        return
    if what == "sum" and not isinstance(arg(1, "start", 0), (int, float)):  # list + list a step: quadratic
        _refuse("sum with a start that is not a number")
    if what == "int" and isinstance(value, str) and len(value) > MAX_INT_TEXT:
        _refuse(f"int of a {len(value)}-character string is past the {MAX_INT_TEXT} read")
    if what == "tojson":  # transformers' signature: (value, ensure_ascii, indent, separators, sort_keys)
        indent = arg(1, "indent")
        if isinstance(indent, int) and not isinstance(indent, bool) and indent > MAX_JSON_INDENT:
            _refuse(f"tojson(indent={indent}) is past {MAX_JSON_INDENT}")
    if not isinstance(value, str):
        return
    if what == "replace":
        old, new = arg(0, "old"), arg(1, "new")
        if isinstance(old, str) and new is not None:
            new_len = text_bound(new)
            current().room(len(value) + (len(value) + 1 if old == "" else value.count(old)) * new_len)
    elif what == "expandtabs":
        current().room(len(value) + value.count("\t") * int(arg(0, "tabsize", 8)))
    elif what == "indent":
        width = arg(0, "width", 4)
        current().room(len(value) + (value.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width)))
    elif what == "format":  # the filter: value % (kwargs or args)
        check_percent(value, kwargs if kwargs else (args if len(args) != 1 else args[0]))
