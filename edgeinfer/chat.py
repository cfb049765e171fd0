"""Chat templates: the model's own Jinja template (Hugging Face conventions), or a plain fallback.

The fallback, for models that ship no template (stories260K), renders each message on its own
line as "System: ...", "User: ...", "Assistant: ..." and ends with "Assistant:" when a reply is wanted.
A content that begins with a space follows the colon directly: a reply generated after "Assistant:"
(" Anna said") renders as the text the model saw, so a conversation continued turn by turn and one
started afresh from its messages feed the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from edgeinfer.errors import InvalidArgumentError, ModelFormatError
from edgeinfer.tokenizer import check_utf8
from edgeinfer.template_sandbox import MAX_TEMPLATE_CHARS, budget, compile_template  # noqa: F401 (re-exported)

ROLES = ("system", "user", "assistant")
MAX_RENDER_CHARS = 16 << 20  # a rendered prompt (the daemon reads bodies of 1 MiB)


def check_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages as plain {"role", "content"} dicts; InvalidArgumentError (a ValueError) unless
    `messages` is a non-empty list of dicts with a role in ROLES and string content (valid UTF-8)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES \
                or not isinstance(m.get("content"), str):  # (a role not a string: an array's `in` raised ValueError)
            raise InvalidArgumentError(f"message {i} must be a dict with role in {ROLES} and string content")
        check_utf8(m["content"], f"message {i} ({m['role']})")  # here, the position the message's own (the
        # rendering's encode would name its place in the rendering)
        out.append({"role": m["role"], "content": m["content"]})
    return out


RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")
MAX_VARIABLE_DEPTH = 16


def check_variables(variables, defuse: Callable[[str], str] | None = None) -> dict:
    """Extra variables for a chat template (transformers' `apply_chat_template(**kwargs)`, the
    `chat_template_kwargs` of OpenAI-compatible servers: Qwen3's `enable_thinking`) as a plain dict
    of JSON values, every string in them passed through `defuse` (a client's text, as a message's
    content is). InvalidArgumentError for anything else: a name that is not a string or is one the
    rendering sets itself (RESERVED_VARIABLES), a value that is not JSON, nesting past
    MAX_VARIABLE_DEPTH."""
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise InvalidArgumentError(f"template variables must be a dict, got {type(variables).__name__}")

    def plain(v, where: str, depth: int):
        if depth > MAX_VARIABLE_DEPTH:
            raise InvalidArgumentError(f"template variable {where} nests deeper than {MAX_VARIABLE_DEPTH}")
        if v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, str):
            check_utf8(v, f"template variable {where}")
            return defuse(v) if defuse is not None else v
        if isinstance(v, (list, tuple)):
            return [plain(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):  # keys are a client's text too: a
            return {plain(k, f"{where} key", depth + 1): plain(x, f"{where}.{k}", depth + 1)  # template may
                    for k, x in v.items()}  # write them (tojson, items()): a review forged an EOS through one
        raise InvalidArgumentError(f"template variable {where} must be JSON (null, a boolean, a number, a string, "
                                   f"a list or an object with string keys), got {type(v).__name__}")

    out = {}
    for k, v in variables.items():
        if not isinstance(k, str) or k in RESERVED_VARIABLES:
            raise InvalidArgumentError(f"template variable name {k!r:.40}: names must be strings other than "
                                       f"{', '.join(RESERVED_VARIABLES)}, which the rendering sets")
        out[k] = plain(v, k, 1)
    return out


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
               defuse: Callable[[str], str] | None = None, variables: dict | None = None,
               undefuse: Callable[[str], str] | None = None) -> str:
        """The prompt text; `defuse` (the tokenizer's) is applied to each message's content first, so
        that a control token's string in it stays text when the rendering is encoded, and `undefuse`
        (the tokenizer's) to a refusal's words (a template's raise_exception quoting a message showed
        the placeholders). `variables`: more names for the template (`check_variables`); the plain
        fallback has no use for them."""
        messages = check_messages(messages)
        variables = check_variables(variables, defuse)
        if defuse is not None:
            messages = [{"role": m["role"], "content": defuse(m["content"])} for m in messages]
        if self.error is not None:
            raise self.error
        if self._tpl is None:
            lines = [f"{m['role'].capitalize()}:{'' if m['content'][:1] == ' ' else ' '}{m['content']}"
                     for m in messages]
            if add_generation_prompt:
                lines.append("Assistant:")
            return "\n".join(lines)
        try:
            pieces, size = [], 0
            with budget():  # loops and built strings bounded per render (template_sandbox)
                for piece in self._tpl.generate(variables, messages=messages,
                                                add_generation_prompt=add_generation_prompt,
                                                bos_token=self.bos_token, eos_token=self.eos_token):
                    size += len(piece)
                    if size > MAX_RENDER_CHARS:  # a loop that writes without end
                        raise InvalidArgumentError(f"chat template: the rendering passed {MAX_RENDER_CHARS} "
                                                   "characters")
                    pieces.append(piece)
            return "".join(pieces)
        except InvalidArgumentError as e:
            text = undefuse(str(e)) if undefuse is not None else str(e)
            if text == str(e):
                raise
            raise InvalidArgumentError(text) from None
        except Exception as e:  # the template itself fails on these messages (a broken or hostile template:
            # Jinja's filters raise AttributeError, RuntimeError and more on odd arguments)
            text = undefuse(str(e)) if undefuse is not None else str(e)  # (a Jinja error quoting a message showed
            raise InvalidArgumentError(f"the model's chat template failed on these messages: "  # the placeholder)
                                       f"{e.__class__.__name__}: {text[:300]}") from None
