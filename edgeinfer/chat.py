"""Chat templates: the model's own Jinja template (Hugging Face conventions), or a plain fallback.

The fallback, for models that ship no template (stories260K), renders each message on its own
line as "System: ...", "User: ...", "Assistant: ..." and ends with "Assistant:" when a reply is wanted.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from edgeinfer.errors import InvalidArgumentError, ModelFormatError

ROLES = ("system", "user", "assistant")
MAX_TEMPLATE_CHARS = 256 * 1024  # Hugging Face templates are a few KB; compiling costs ~6 s per MB
MAX_REPEAT_ITEMS = 1 << 20  # a template's `*` may build a string or list of at most this many items
MAX_INT_BITS = 1 << 16  # and `**` an integer of at most this many bits
MAX_RENDER_CHARS = 16 << 20  # a rendered prompt (the daemon reads bodies of 1 MiB)


def _raise(message: str):
    """The templates' `raise_exception`: the template refuses these messages (a user error)."""
    raise InvalidArgumentError(f"chat template: {message}")


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages as plain {"role", "content"} dicts; InvalidArgumentError (a ValueError) unless
    `messages` is a non-empty list of dicts with a role in ROLES and string content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidArgumentError(f"message {i} must be a dict with role in {ROLES} and string content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def compile_template(template: str):
    """The Jinja template object for `template`, in the sandbox Hugging Face templates expect (with
    `raise_exception`, and `{% generation %}` blocks rendered as their body: transformers' tag that
    marks the assistant's tokens for training); ModelFormatError when it does not parse (the
    model's fault, not the caller's: the daemon answers 500)."""
    import jinja2  # only models with a template pay for importing it (about 30 ms)
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The operators that build large values bounded: `'a' * 10**10`, `(9**1000)**1000`,
        `'%999999999d' % 1`, `'{:>999999999}'.format(1)` are refused (intercepted operators are not
        folded at compile time either); what a render yields in all is capped (`ChatTemplate.render`).
        Not bounded: a filter on constants is still run when compiling (`'a'|center(99999999)`: 0.6 s
        and 100 MB at load; at 10**10 a MemoryError, so a template error), and a loop that writes
        nothing runs as long as it runs. The template comes with the model, not from a client."""

        intercepted_binops = frozenset({"*", "**", "%"})

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
            return super().call_binop(context, operator, left, right)

        def format_string(self, s, args, kwargs, format_func=None):
            if re.search(r"\{[^{}]*:[^{}]*(\d{5}|\{)", s):  # a width of 5 digits, or one taken from an argument
                raise InvalidArgumentError(f"chat template: the format {s!r:.40} pads too widely")
            return super().format_string(s, args, kwargs, format_func)

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ModelFormatError(f"the model's chat template is {len(template)} characters, more than the "
                               f"{MAX_TEMPLATE_CHARS} read")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template)
    except (jinja2.TemplateError, RecursionError, MemoryError, OverflowError) as e:  # nesting, folded constants
        raise ModelFormatError(f"the model's chat template does not parse: "
                               f"{e.__class__.__name__}: {str(e)[:200]}") from None


class ChatTemplate:
    """Renders messages to prompt text. `bos_token` / `eos_token` are the tokens' own strings ("<s>",
    "<|im_end|>": `Tokenizer.token_string`), as Hugging Face templates expect; "" for none. A template
    that does not parse is refused when rendering (`error`, a ModelFormatError), not when the model
    loads: the model still completes plain prompts."""

    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._tpl = None
        self.error: ModelFormatError | None = None
        if template:
            try:
                self._tpl = compile_template(template)
            except ModelFormatError as e:
                self.error = e

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True,
               defuse: Callable[[str], str] | None = None) -> str:
        """The prompt text; `defuse` (the tokenizer's) is applied to each message's content first, so
        that a control token's string in it stays text when the rendering is encoded."""
        messages = check_messages(messages)
        if defuse is not None:
            messages = [{"role": m["role"], "content": defuse(m["content"])} for m in messages]
        if self.error is not None:
            raise self.error
        if self._tpl is None:
            lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
            if add_generation_prompt:
                lines.append("Assistant:")
            return "\n".join(lines)
        import jinja2

        try:
            pieces, size = [], 0
            for piece in self._tpl.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                            bos_token=self.bos_token, eos_token=self.eos_token):
                size += len(piece)
                if size > MAX_RENDER_CHARS:  # a loop that writes without end
                    raise InvalidArgumentError(f"chat template: the rendering passed {MAX_RENDER_CHARS} characters")
                pieces.append(piece)
            return "".join(pieces)
        except InvalidArgumentError:
            raise
        except (jinja2.TemplateError, OverflowError, ArithmeticError, TypeError, ValueError, LookupError,
                RecursionError, MemoryError) as e:  # the template itself fails on these messages (a broken or
            # hostile template)
            raise InvalidArgumentError(f"the model's chat template failed on these messages: "
                                       f"{e.__class__.__name__}: {e}") from None
