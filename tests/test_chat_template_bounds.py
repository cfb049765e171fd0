"""A hostile chat template (it comes with the model folder) is refused with a clear error, at load
(chat and conversations refuse it; plain completions still work) or when rendering, never a
traceback, an exhausted memory or a minutes-long load. Found by a hostile round (2026-12-01):
3,000 nested parentheses were a RecursionError at load, `'%999999999d' % 1` a MemoryError at load
(Jinja folds constants when compiling), a 2.5 MB template cost 15 s on every load, and
`'a' * 10**10` was a MemoryError when rendering."""

from __future__ import annotations

import pytest

from edgeinfer.chat import MAX_TEMPLATE_CHARS, ChatTemplate
from edgeinfer.errors import InvalidArgumentError, ModelFormatError

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template,needle", [
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "does not parse"),
    ("{{ 'x' }}" * (MAX_TEMPLATE_CHARS // 9 + 1), "more than the"),
])
def test_a_template_that_cannot_be_compiled_sanely_is_a_template_error(template, needle):
    t = ChatTemplate(template)
    assert isinstance(t.error, ModelFormatError) and needle in str(t.error)
    with pytest.raises(ModelFormatError):
        t.render(HI)


@pytest.mark.parametrize("template", ["{{ 'a' * 10**10 }}", "{{ 10**10 * 'a' }}", "{{ [1] * 10**9 }}",
                                      "{{ 2 ** 100000 }}", "{{ '%999999999d' % 1 }}"])
def test_a_template_that_would_exhaust_memory_when_rendering_is_refused(template):
    t = ChatTemplate(template)
    assert t.error is None
    with pytest.raises(InvalidArgumentError, match="chat template"):
        t.render(HI)


def test_ordinary_repetition_and_powers_still_render():
    assert ChatTemplate("{{ '-' * 3 }}{{ 2 ** 10 }}{{ [0] * 2 }}{{ '%3d|' % 7 }}").render(HI) == "---1024[0, 0]  7|"


@pytest.mark.parametrize("template", [
    "{{ (((9 ** 1000) ** 1000) ** 100) > 1 }}",  # each exponent small, the integer enormous (226 s)
    "{{ '%*d' % (99999999, 1) }}", "{{ '{:>99999999}'.format(1) }}", "{{ '{:{}}'.format(1, 99999999) }}",
    "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
])
def test_what_a_review_got_past_the_first_bounds_is_refused(template):
    t = ChatTemplate(template)
    assert t.error is None
    with pytest.raises(InvalidArgumentError, match="chat template"):
        t.render(HI)

