"""The Jinja sandbox that runs a model's chat template, and what one render may cost.

A chat template comes inside the model file (a GGUF's `tokenizer.chat_template`, a Hugging Face
folder's tokenizer_config.json), so a model downloaded from anywhere brings code that runs on every
chat turn, in the CLI and in the daemon. Jinja's sandbox keeps it from Python's internals; this
module also bounds what it can spend, per render:

1. Time and loop iterations: every `{% for %}` draws its items through `MAX_LOOP_ITEMS` in all
   (nested `range(99999)` loops that write nothing ran for hours), and every hook below checks the
   render's deadline, `MAX_RENDER_S` (a macro recursing 2^40 times, a recursive loop, a scan of a
   big list in each iteration: work no count sees).
2. Characters built: every string or list that `~`, `+`, `*`, a filter, a method call, a macro or a
   block `{% set %}` makes counts its length against `MAX_BUILT_CHARS` (forty `{% set a = a ~ a %}`
   grew without end; so would `a|replace('x', 'xx')`); one value is at most `MAX_REPEAT_ITEMS` items
   when `*` builds it; and what can make far more than it is given is refused before it runs: an
   integer argument to a string method or a filter past `MAX_ARG_INT` (`center(10**9)`), a replace,
   join, indent, wordwrap or expandtabs whose most possible output has no room left, a block's output
   too long to join, `tojson(indent)` past `MAX_JSON_INDENT`; `lipsum` is gone from the globals.
3. Operators that build huge values in one step are refused before they run: `**` past
   `MAX_INT_BITS`, and `%` / `.format` padding of five digits or more.
What a render writes is capped by `ChatTemplate.render` (`chat.MAX_RENDER_CHARS`). Real templates
use a few hundred iterations and a few KB (SmolLM2's: 9 iterations for 4 messages).

The loop and concatenation hooks are put into the template's syntax tree before it is compiled
(`Hooks`), so they hold however the template is written; the budget is per render (`budget()`).
Still not bounded: a filter on constants runs when compiling (`'a'|center(99999999)`: 0.6 s and
100 MB at load; at 10**10 a MemoryError, so a template error).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time

from edgeinfer.errors import InvalidArgumentError, ModelFormatError

MAX_TEMPLATE_CHARS = 256 * 1024  # Hugging Face templates are a few KB; compiling costs ~6 s per MB
MAX_REPEAT_ITEMS = 1 << 20  # a template's `*` may build a string or list of at most this many items
MAX_INT_BITS = 1 << 16  # and `**` an integer of at most this many bits
MAX_LOOP_ITEMS = 1 << 20  # loop iterations in one render (about a second of Jinja)
MAX_BUILT_CHARS = 64 << 20  # characters (or list items) built in one render
MAX_RENDER_S = 5.0  # one render's wall time (real templates: milliseconds, 40 ms for 6,000 messages)
MAX_ARG_INT = 1 << 20  # an integer given to a string method or a filter (a width, a tab size, an indent)


class Budget:
    """What one render has left to spend; InvalidArgumentError once a limit is passed. Every hook
    (a loop's item, a call, a value built, a block's output joined) also checks the render's
    deadline: work no hook counts (a macro that recurses without writing, a comparison over a big
    list inside a loop) is bounded by it."""

    def __init__(self):
        self.loop_items, self.built_chars = MAX_LOOP_ITEMS, MAX_BUILT_CHARS
        self.deadline = time.monotonic() + MAX_RENDER_S

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise InvalidArgumentError(f"chat template: one render ran past {MAX_RENDER_S:g} s")

    def loop(self, iterable):
        for item in iterable:
            self.loop_items -= 1
            if self.loop_items < 0:
                raise InvalidArgumentError(f"chat template: its loops passed {MAX_LOOP_ITEMS} iterations in one render")
            self.tick()
            yield item

    def room(self, chars: int) -> None:
        """Refuse, before it is made, a value of up to `chars` characters that the budget cannot hold."""
        if chars > self.built_chars:
            raise InvalidArgumentError(f"chat template: it would build {chars} characters, past the "
                                       f"{max(self.built_chars, 0)} left of the {MAX_BUILT_CHARS} one render may build")

    def built(self, value):
        self.tick()
        if isinstance(value, (str, list, tuple)):
            self.built_chars -= len(value)
            if self.built_chars < 0:
                raise InvalidArgumentError(f"chat template: it built more than {MAX_BUILT_CHARS} characters in one "
                                           "render")
        return value


_BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("edgeinfer_template_budget")


@contextlib.contextmanager
def budget():
    """A fresh Budget for the renders inside (one render: `ChatTemplate.render`)."""
    token = _BUDGET.set(Budget())
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _current() -> Budget:
    b = _BUDGET.get(None)
    if b is None:
        raise RuntimeError("a chat template renders inside template_sandbox.budget() (ChatTemplate.render)")
    return b


def _loop(iterable):
    """The items of a template's `{% for %}`, each counted."""
    return _current().loop(iterable)


def _concat(items) -> str:
    """A template's `a ~ b ~ ...` (Jinja's str_join), counted."""
    return _current().built("".join(map(str, items)))


def _joined(pieces) -> str:
    """The environment's `concat`: a macro's output, a block `{% set %}`'s, a filter block's, joined
    once their length is known to fit (`{% set a %}{{ a }}{{ a }}{% endset %}` doubled without a hook)."""
    pieces = list(pieces)
    b = _current()
    b.room(sum(map(len, pieces)))
    return b.built("".join(pieces))


def _check_args(what: str, value, args: tuple, kwargs: dict) -> None:
    """Before a string method or a filter `what` runs on `value`: no integer argument past MAX_ARG_INT
    (`'x'.center(10**9)` took 1 GB before its result could be counted), and for those that can make
    far more than they are given, room for the most they can make."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARG_INT:
            raise InvalidArgumentError(f"chat template: {what}({str(a)[:24]}) is past the {MAX_ARG_INT} a template "
                                       "may ask")
    if not isinstance(value, str) and what != "join":
        return
    arg = (lambda i, key, default=None: args[i] if len(args) > i else kwargs.get(key, default))
    if what == "replace" and isinstance(arg(0, "old"), str) and isinstance(arg(1, "new"), str):
        old, new = arg(0, "old"), arg(1, "new")
        _current().room(len(value) + (len(value) + 1 if old == "" else value.count(old)) * len(new))
    elif what == "join" and isinstance(value, (list, tuple)):  # the join filter: value is the items
        sep = arg(0, "d", "")
        _current().room(len(str(sep)) * len(value) + sum(len(x) if isinstance(x, str) else 64 for x in value))
    elif what == "expandtabs":
        _current().room(len(value) + value.count("\t") * int(arg(0, "tabsize", 8)))
    elif what in ("indent", "wordwrap"):
        lines = value.count("\n") + 1 if what == "indent" else len(value) // max(int(arg(0, "width", 79)), 1) + 1
        extra = arg(0, "width", 4) if what == "indent" else (arg(2, "wrapstring") or "\n")
        _current().room(len(value) + lines * (len(extra) if isinstance(extra, str) else int(extra)))
    elif what == "format" and re.search(r"%[^a-zA-Z%]*(\d{5}|\*)", value):
        raise InvalidArgumentError(f"chat template: the format {value!r:.40} pads too widely")


MAX_JSON_INDENT = 64  # tojson(indent=n): every nested line gets n spaces per level


def _check_tojson(args: tuple, kwargs: dict) -> None:
    indent = args[0] if args else kwargs.get("indent")
    if isinstance(indent, int) and not isinstance(indent, bool) and indent > MAX_JSON_INDENT:
        raise InvalidArgumentError(f"chat template: tojson(indent={indent}) is past {MAX_JSON_INDENT}")


LOOP_FILTER, CONCAT_FILTER = "edgeinfer_loop", "edgeinfer_concat"  # the hooks' names among the filters


def _raise(message: str):
    """The templates' `raise_exception`: the template refuses these messages (a user error)."""
    raise InvalidArgumentError(f"chat template: {message}")


def compile_template(template: str):
    """The Jinja template object for `template`, in the sandbox Hugging Face templates expect (with
    `raise_exception`, and `{% generation %}` blocks rendered as their body: transformers' tag that
    marks the assistant's tokens for training), with the module doc's bounds; ModelFormatError when
    it does not parse (the model's fault, not the caller's: the daemon answers 500)."""
    import jinja2  # only models with a template pay for importing it (about 30 ms)
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Hooks(NodeTransformer):
        """Each loop's items through `_loop`, each `~` through `_concat`, as filters: Jinja calls a filter
        directly (a call through the sandbox's `call` cost 1 µs more each), and a template cannot define
        one, so a `{% set %}` or a macro of the same name does not replace the hook."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, LOOP_FILTER, [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), CONCAT_FILTER, [], [], None, None,
                                lineno=node.lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and max(left.bit_length(), 1) * right > MAX_INT_BITS:
                raise InvalidArgumentError(f"chat template: {left!r:.20} ** {right} is too large")
            if operator == "%" and isinstance(left, str) and re.search(r"%[^a-zA-Z%]*(\d{5}|\*)", left):
                raise InvalidArgumentError(f"chat template: the format {left!r:.40} pads too widely")
            if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
            if operator == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int) \
                    and len(left) * right > MAX_REPEAT_ITEMS:
                raise InvalidArgumentError(f"chat template: repeating {len(left)} items {right} times is too many")
            return _current().built(super().call_binop(context, operator, left, right))

        def format_string(self, s, args, kwargs, format_func=None):
            if re.search(r"\{[^{}]*:[^{}]*(\d{5}|\{)", s):  # a width of 5 digits, or one taken from an argument
                raise InvalidArgumentError(f"chat template: the format {s!r:.40} pads too widely")
            return super().format_string(s, args, kwargs, format_func)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            _current().tick()
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):  # a string's method: 'x'.center(n), sep.join(items), s.replace(a, b)
                name = getattr(__obj, "__name__", "")
                if name == "join" and args and isinstance(args[0], (list, tuple)):
                    _check_args("join", list(args[0]), (owner,), {})
                else:
                    _check_args(name, owner, args, kwargs)
            return _current().built(super().call(__context, __obj, *args, **kwargs))

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ModelFormatError(f"the model's chat template is {len(template)} characters, more than the "
                               f"{MAX_TEMPLATE_CHARS} read")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = _raise
    del env.globals["lipsum"]  # lipsum(n=10**6) writes a million paragraphs; no chat template uses it
    env.concat = _joined
    env.filters = {name: _counted(name, f) for name, f in env.filters.items()} | {LOOP_FILTER: _loop,
                                                                                   CONCAT_FILTER: _concat}
    try:
        tree = Hooks().visit(env.parse(template))
        return env.template_class.from_code(env, env.compile(tree), env.make_globals(None), None)
    except (jinja2.TemplateError, RecursionError, MemoryError, OverflowError) as e:  # nesting, folded constants
        raise ModelFormatError(f"the model's chat template does not parse: "
                               f"{e.__class__.__name__}: {str(e)[:200]}") from None


def _counted(name: str, f):
    """Filter `name` whose arguments are checked first (`_check_args`) and whose result counts against
    the render's budget (Jinja's pass_context and the like, attributes of the function, are kept by
    `functools.wraps`; such a filter's first argument is the context, its value the second)."""
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(f) is None else 1

    @functools.wraps(f)
    def counted(*args, **kwargs):
        if len(args) > skip:
            _check_args(name, args[skip], args[skip + 1:], kwargs)
            if name == "tojson":
                _check_tojson(args[skip + 1:], kwargs)
        return _current().built(f(*args, **kwargs))
    return counted
