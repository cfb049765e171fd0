"""The Jinja sandbox that runs a model's chat template, with the per-render limits of
`template_budget` enforced by hooks.

A chat template comes inside the model file (a GGUF's `tokenizer.chat_template`, a Hugging Face
folder's tokenizer_config.json), so a model downloaded from anywhere brings code that runs on every
chat turn, in the CLI and in the daemon. Jinja's sandbox keeps it from Python's internals; the hooks
keep it from spending without bound (each found by a hostile review: nested loops that wrote nothing
ran for hours, doubled strings and lists took the memory, one C call on a huge value ran for minutes,
a deeply nested tuple crashed the interpreter):

- put into the syntax tree before compiling (`Hooks`), so they hold however the template is written:
  every `{% for %}`'s items through `Budget.loop`; every `~`, slice, list, tuple and dict literal
  through `Budget.built` (its logical size and depth);
- only the methods chat templates call (`METHODS`: a string's, a dict's, a list's; none of bytes' or
  ints'), and no filter that can run for minutes in one call (`BLOCKED_FILTERS`);
- in the environment (`Sandbox`): every call (a macro, a string method, a global, a recursive loop's
  `loop(...)`, whose items then go through `Budget.loop` too), arithmetic and `%`, `.format`, and
  every filter and test check their arguments first and count what they return; a macro's, a block
  `{% set %}`'s or a filter block's output is joined only when its length fits (`concat`);
- `lipsum` is not there (`lipsum(n=10**6)`); constant folding is off (Jinja's optimizer tried to fold
  every node of a chain at every level: 45 s to compile 22 KB of 180-deep filter chains; and it ran
  filters on constants while compiling); a template nested more than `MAX_NESTING` deep is refused
  before compiling (Python's own compiler fails past 100 nested blocks or 200 parentheses).
What a render writes is capped by `ChatTemplate.render` (`chat.MAX_RENDER_CHARS`). Real templates use
a few hundred iterations and a few KB (SmolLM2's: 9 iterations for 4 messages), and render exactly as
Jinja's own sandbox renders them (tests/test_chat_template_bounds.py compares).
"""

from __future__ import annotations

import functools

from edgeinfer.errors import InvalidArgumentError, ModelFormatError
from edgeinfer.template_budget import (MAX_REPEAT_ITEMS, budget, check_args, check_format, check_int_op,  # noqa: F401
                                       check_percent, check_repeat, current)

MAX_TEMPLATE_CHARS = 256 * 1024  # Hugging Face templates are a few KB; compiling costs ~6 s per MB
MAX_NESTING = 64  # syntax nested this deep (real templates: under 15)
MAX_STRFTIME_CHARS = 256  # a date's format (Llama 3.2's: "%d %b %Y")
LOOP_FILTER, VALUE_FILTER = "edgeinfer_loop", "edgeinfer_value"  # the hooks' names among the filters


def _raise(message: str):
    """The templates' `raise_exception`: the template refuses these messages (a user error)."""
    raise InvalidArgumentError(f"chat template: {message}")


def _strftime_now(format: str) -> str:
    """The templates' `strftime_now`: the local time now in `format`, as transformers gives it (Llama
    3.2's template writes today's date with it; without it, it wrote a fixed date of 2024)."""
    import datetime

    if not isinstance(format, str):
        raise InvalidArgumentError(f"chat template: strftime_now takes a format string, got {type(format).__name__}")
    # one C call whose output grows 12x ("%c"), counted only after it: a review's 32 M characters ran 13 s, 2 GB
    if len(format) > MAX_STRFTIME_CHARS:
        raise InvalidArgumentError(f"chat template: strftime_now's format is {len(format)} characters, more "
                                   f"than the {MAX_STRFTIME_CHARS} a date takes")
    return datetime.datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The templates' `tojson` as transformers defines it (`json.dumps`, keys in their order, non-ASCII
    and `<>&'` as they are), not Jinja's HTML-safe one, which escaped them and sorted the keys."""
    import json

    if separators is not None and (not isinstance(separators, (list, tuple)) or len(separators) != 2
                                   or not all(isinstance(x, str) and len(x) <= 8 for x in separators)):
        raise InvalidArgumentError("chat template: tojson's separators must be two strings of at most 8 characters")
    if isinstance(indent, str) and len(indent) > 8:  # repeated at every level of every item
        raise InvalidArgumentError("chat template: tojson's indent string is longer than 8 characters")
    return json.dumps(value, ensure_ascii=bool(ensure_ascii), indent=indent, separators=separators,
                      sort_keys=bool(sort_keys))


def _loop(iterable):
    """The items of a template's `{% for %}`, each counted."""
    return current().loop(iterable)


def _value(value):
    """A `~` (its items joined as Jinja's str_join does) or a list, tuple or dict literal, counted."""
    return current().built(value)


def _concat_items(items) -> str:
    b = current()
    for x in items:  # str() of a container costs its logical size: measured (and refused past the budget) first
        if isinstance(x, (list, tuple, dict)):
            b.measure(x)
    return b.built("".join(map(str, items)))


def _joined(pieces) -> str:
    """The environment's `concat`: a macro's output, a block `{% set %}`'s, a filter block's, joined
    once their length is known to fit (`{% set a %}{{ a }}{{ a }}{% endset %}` doubled without a hook)."""
    pieces = list(pieces)
    b = current()
    b.room(sum(map(len, pieces)))
    return b.built("".join(pieces))


def _nesting(node, limit: int) -> int:
    """The depth of a syntax tree, walked without recursion; stops past `limit`."""
    deepest, stack = 0, [(node, 1)]
    while stack:
        n, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in n.iter_child_nodes())
    return deepest


def compile_template(template: str):
    """The Jinja template object for `template`, in the sandbox Hugging Face templates expect (as
    transformers sets it up: `raise_exception`, `strftime_now`, its own `tojson`, `{% break %}` and
    `{% continue %}`, and `{% generation %}` blocks rendered as their body: transformers' tag that
    marks the assistant's tokens for training), with the module doc's hooks; ModelFormatError when
    it does not parse (the model's fault, not the caller's: the daemon answers 500)."""
    import jinja2  # only models with a template pay for importing it (about 30 ms)
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def hook(node, name: str):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Hooks(NodeTransformer):
        """The hooks are filters: Jinja calls a filter directly (a call through the sandbox's `call`
        cost 1 µs more each), and a template cannot define one, so a `{% set %}` or a macro of the
        same name does not replace them."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = hook(node.iter, LOOP_FILTER)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return hook(nodes.List(node.nodes, lineno=node.lineno), "edgeinfer_concat")

        def _literal(self, node):
            node = self.generic_visit(node)
            return node if getattr(node, "ctx", "load") != "load" else hook(node, VALUE_FILTER)

        visit_List = visit_Tuple = visit_Dict = _literal

        def visit_Getitem(self, node):  # a slice copies (s[::-1] fifty times: 2 GB), and Jinja writes a
            node = self.generic_visit(node)  # slice as Python's own subscript, past the sandbox's getitem
            return hook(node, VALUE_FILTER) if isinstance(node.arg, nodes.Slice) and node.ctx == "load" else node

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+", "-", "/", "//"})

        def call_binop(self, context, operator, left, right):
            if operator == "+" and type(left) is str and type(right) is str:  # the commonest, kept cheap: counted
                out = left + right  # in place (the deadline is checked at the next loop item or call)
                b = current()
                b.units -= len(out)
                return out if b.units >= 0 else b.built(out)
            check_int_op(operator, left, right)
            if operator == "%":
                check_percent(left, right)
            elif operator == "*":
                check_repeat(left, right)
            return current().built(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):  # Jinja 3.1 hands a template `str.format` wrapped by this
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            mapping = value.__name__ == "format_map"

            @functools.wraps(wrapped)
            def checked(*args, **kwargs):  # what it can make, summed before formatting ('{0:😀>9999}' * 10**5: 4 GB)
                if mapping and len(args) == 1 and isinstance(args[0], dict):
                    check_format(value.__self__, (), args[0])
                else:
                    check_format(value.__self__, args, kwargs)
                return wrapped(*args, **kwargs)
            return checked

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
            b = current()
            b.tick()
            owner = getattr(__obj, "__self__", None)
            if owner is not None and type(__obj).__name__ in _BUILTIN_METHODS:  # a C type's method (Jinja's own
                # objects, loop.cycle and the like, have Python methods: not checked)
                _check_method(owner, getattr(__obj, "__name__", ""))
            if isinstance(owner, str):  # a string's method: 'x'.center(n), sep.join(items), s.replace(a, b)
                name = getattr(__obj, "__name__", "")
                if name == "join" and args:
                    items = args[0] if isinstance(args[0], (str, list, tuple)) else list(b.loop(args[0]))
                    check_args("join", items, (owner,), {})
                    args = (items, *args[1:])
                else:
                    check_args(name, owner, args, kwargs)
            elif isinstance(__obj, LoopContext) and args:  # a recursive loop's loop(items): counted too
                args = (b.loop(args[0]), *args[1:])
            return b.built(super().call(__context, __obj, *args, **kwargs))

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ModelFormatError(f"the model's chat template is {len(template)} characters, more than the "
                               f"{MAX_TEMPLATE_CHARS} read")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"],
                  optimized=False)  # no constant folding: it tried to fold every node of a chain at every level
    # (a 256 KB template of 30-deep chains compiled in 20 s), and it ran filters on constants while compiling
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    del env.globals["lipsum"]  # lipsum(n=10**6) writes a million paragraphs; no chat template uses it
    env.concat = _joined
    env.filters = {name: _counted(name, f) for name, f in env.filters.items() if name not in BLOCKED_FILTERS} | {
        LOOP_FILTER: _loop, VALUE_FILTER: _value, "edgeinfer_concat": _concat_items}
    env.tests = {name: _ticked(f) for name, f in env.tests.items()}
    try:
        tree = env.parse(template)
        if _nesting(tree, MAX_NESTING) > MAX_NESTING:
            raise ModelFormatError(f"the model's chat template nests more than {MAX_NESTING} deep")
        return env.template_class.from_code(env, env.compile(Hooks().visit(tree)), env.make_globals(None), None)
    except (jinja2.TemplateError, RecursionError, MemoryError, OverflowError, SyntaxError, ValueError) as e:
        # nesting Python cannot compile, constants folded at compile time (a 5,000-digit literal)
        raise ModelFormatError(f"the model's chat template does not parse: "
                               f"{e.__class__.__name__}: {str(e)[:200]}") from None


BLOCKED_FILTERS = frozenset({"urlize", "wordwrap", "batch", "slice"})  # no chat template uses them, and each can
# run for minutes in one call (urlize's regex backtracks on ')' * 200,000; wordwrap is quadratic) or repeat a
# fill value a million times (batch, slice)
METHODS = {  # what a chat template may call on a value; any other method (bytes' and ints' among them:
    # (1).to_bytes(2 * 10**9) and 'x'.encode() * 2000 took 2 GB) is refused
    str: frozenset({"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "lower",
                    "upper", "title", "capitalize", "casefold", "swapcase", "replace", "find", "rfind", "index",
                    "rindex", "count", "join", "format", "format_map", "removeprefix", "removesuffix", "partition",
                    "rpartition", "center", "ljust", "rjust", "zfill", "isdigit", "isalpha", "isalnum", "isspace",
                    "isupper", "islower", "isnumeric", "isdecimal", "istitle", "isidentifier", "isprintable"}),
    dict: frozenset({"items", "keys", "values", "get"}),
    list: frozenset({"index", "count"}),
    tuple: frozenset({"index", "count"}),
}
_BUILTIN_METHODS = ("builtin_function_or_method", "method-wrapper")


def _check_method(owner, name: str) -> None:
    allowed = next((names for kind, names in METHODS.items() if isinstance(owner, kind)), frozenset())
    if name not in allowed:
        raise InvalidArgumentError(f"chat template: {type(owner).__name__}.{name}() is not a method chat templates "
                                   "may call")


def _counted(name: str, f):
    """Filter `name` whose arguments are checked first (`check_args`) and whose result counts against
    the render's budget (Jinja's pass_context and the like, attributes of the function, are kept by
    `functools.wraps`; such a filter's first argument is the context, its value the second)."""
    from jinja2.utils import _PassArg

    skip = 0 if _PassArg.from_obj(f) is None else 1

    @functools.wraps(f)
    def counted(*args, **kwargs):
        if len(args) > skip:
            check_args(name, args[skip], args[skip + 1:], kwargs)
        return current().built(f(*args, **kwargs))
    return counted


def _ticked(f):
    """A test (`in`, `eq`, ... in `select('in', big)`) that checks the render's deadline first."""
    @functools.wraps(f)
    def ticked(*args, **kwargs):
        current().tick()
        return f(*args, **kwargs)
    return ticked
