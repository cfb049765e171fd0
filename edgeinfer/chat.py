"""Chat templates: the model's own Jinja template (Hugging Face conventions), or a plain fallback.

The fallback, for models that ship no template (stories260K), renders each message on its own
line as "System: ...", "User: ...", "Assistant: ..." and ends with "Assistant:" when a reply is wanted.
"""

from __future__ import annotations

from collections.abc import Sequence

ROLES = ("system", "user", "assistant")


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def check_messages(messages: Sequence[dict]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with role in {ROLES} and string content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class ChatTemplate:
    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = ""):
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._tpl = None
        if template:
            import jinja2  # only models with a template pay for importing it (about 30 ms)
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._tpl = env.from_string(template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the model's chat template does not parse: {e}") from None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        messages = check_messages(messages)
        if self._tpl is None:
            lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
            if add_generation_prompt:
                lines.append("Assistant:")
            return "\n".join(lines)
        return self._tpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                bos_token=self.bos_token, eos_token=self.eos_token)
