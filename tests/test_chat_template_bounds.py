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



@pytest.mark.parametrize("template", [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",  # writes nothing: ran for hours
    "{% for c in 'x' * 1000000 %}{% for d in 'x' * 1000000 %}{% endfor %}{% endfor %}",
    "{% set a = 'xxxxxxxxxxxxxxxx' %}" + "{% set a = a ~ a %}" * 40 + "{{ a|length }}",  # grew until the OOM killer
    "{% set a = 'xxxxxxxxxxxxxxxx' %}" + "{% set a = a + a %}" * 40 + "{{ a|length }}",
    "{% set a = 'xx' %}" + "{% set a = a|replace('x', 'xx') %}" * 40 + "{{ a|length }}",
    "{% set a = 'xx' %}" + "{% set a = a.replace('x', 'xx') %}" * 40 + "{{ a|length }}",
    "{% set a = ['x'] %}" + "{% set a = a + a %}" * 40 + "{{ a|length }}",
    "{% set ns = namespace(a='x' * 1000000) %}{% for i in range(200) %}{% set ns.a = ns.a ~ 'y' %}{% endfor %}",
])
def test_loops_and_built_strings_are_bounded_per_render(template):
    """A hostile review's templates (a GGUF from anywhere brings one): nested loops that write
    nothing hung `edgeinfer chat` at 100 % CPU, and doubling a string with `~` took the memory.
    Each render now has a loop and a built-characters budget (template_sandbox)."""
    import time

    t = ChatTemplate(template)
    assert t.error is None
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match="chat template: it built|chat template: its loops|it would build"):
        t.render(HI)
    assert time.perf_counter() - t0 < 30


def test_a_template_cannot_shadow_the_hooks():
    """The hooks are imported names: a macro or variable of any name does not replace them."""
    for name in ("_loop", "_concat", "_edgeinfer_loop", "loop_hook"):
        t = ChatTemplate("{% macro " + name + "(x) %}{{ x }}{% endmacro %}{% set " + name + " = 1 %}"
                         "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
        with pytest.raises(InvalidArgumentError, match="its loops"):
            t.render(HI)


def test_the_budget_is_per_render():
    """A template that spends most of its budget renders every time, not only the first."""
    t = ChatTemplate("{% for i in range(9) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
                     "{{ messages[0]['content'] }}")  # 900,000 of the 1,048,576 iterations
    for _ in range(3):
        assert t.render(HI) == "hi"


@pytest.mark.parametrize("template", [
    "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",  # days
    "{% for x in range(2) recursive %}{% if loop.depth < 40 %}{{ loop(range(2)) }}{% endif %}{% endfor %}",
    "{% set big = [0] * 1000000 %}{% for i in range(100000) %}{% if 1 in big %}{% endif %}{% endfor %}",
])
def test_work_no_count_sees_is_bounded_by_the_render_deadline(template, monkeypatch):
    """A review of the first budget: a macro recursing 2^40 times, a recursive loop (its inner
    iterables skip the loop hook) and a scan of a big list in each of 2^20 allowed iterations each
    ran for hours or days. Every hook checks the render's deadline (shortened here)."""
    import time

    from edgeinfer import template_budget

    monkeypatch.setattr(template_budget, "MAX_RENDER_S", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match="ran past 0.5 s"):
        ChatTemplate(template).render(HI)
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize("template, says", [
    ("{% set a = messages[0].content %}" + "{% set a %}{{ a }}{{ a }}{% endset %}" * 40 + "{{ a|length }}",
     "would build"),  # a block set doubling: no ~, no filter (17 GB at 33)
    ("{{ messages[0].content.center(1000000000)|length }}", "past the 1048576"),  # (30 bits)  # 1 GB before it was counted
    ("{{ messages[0].content|center(1000000000) }}", "past the 1048576"),
    ("{{ 'x'.ljust(10**9) }}", "past the 1048576"),
    ("{{ ('%0' ~ '1000000000' ~ 'd')|format(1) }}", "would build"),  # the filter skipped %'s check
    ("{% set s = 'x' * 100000 %}{{ s.replace('', s)|length }}", "would build"),
    ("{% set s = 'x' * 100000 %}{{ s|replace('', s)|length }}", "would build"),
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join|length }}", "would build|built more"),
    ("{% set s = 'x' * 1000000 %}{{ s.join(['a'] * 1000)|length }}", "would build"),
    ("{{ ('\\n' * 1000000)|indent(1000000)|length }}", "would build"),
    ("{{ messages|tojson(indent=100000) }}", "tojson"),
    ("{{ lipsum(n=1000000) }}", "lipsum"),
])
def test_what_builds_far_more_than_it_is_given_is_refused_before_it_runs(template, says):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidArgumentError, match=says):
        ChatTemplate(template).render(HI)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 600 * 1024  # KB: no GB allocated


def test_templates_with_block_sets_tojson_and_joins_render_as_plain_jinja_does():
    """The hooks change no rendering: the reference is Jinja's own sandbox, without them."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    src = ("{% set sys %}{{ messages[0]['content']|upper }}{% endset %}{{ sys }}|"
           "{{ messages|map(attribute='role')|join(', ') }}|{{ {'a': [1, 2]}|tojson(indent=2) }}|"
           "{{ '  x'.center(7) ~ 'ab'.replace('a', 'A') ~ ('x\\ny'|indent(2)) }}"
           "{% macro m(n) %}<{{ n }}>{% endmacro %}{% for i in range(3) %}{{ m(i) }}{% endfor %}")
    want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(src).render(messages=HI)
    assert ChatTemplate(src).render(HI) == want and "<2>" in want


@pytest.mark.parametrize("template, says", [
    ("{% set ns = namespace(a=(1,)) %}{% for j in range(3) %}{% for i in range(100000) %}{% set ns.a = (ns.a,) %}"
     "{% endfor %}{% endfor %}{{ {ns.a: 1}|length }}", "nests values more than 256 deep"),  # hash(): SIGSEGV
    ("{% set a = [1] %}" + "{% set a = [a, a] %}" * 60 + "{{ a }}", "would build"),  # 2^60 to print
    ("{% set a = [1] %}" + "{% set a = [a, a] %}" * 60 + "{{ a|tojson }}", "would build"),
    ("{% set l = range(100000)|list %}{% set l2 = range(99999)|list + [0] %}{{ l2 in [l] * 1000000 }}",
     "would build"),  # 1e11 comparisons in one `in`
    ("{% set s = 'a' * 1000000 %}{% set t = 'a' * 1000000 %}{{ ([s, t] * 500000)|max|length }}", "built more"),
    ("{% set s = 'f' * 1000000 %}{% set s = s ~ s %}{% set n = s|int(base=16) %}{{ n // 7 }}", "int of a"),
    ("{% set m = ('f' * 1000)|int(base=16) %}{% set m = m ** 5 %}{{ (m * m) // 7 }}", "bits"),
    ("{{ ('{0:😀>9999}' * 100000).format('')|length }}", "would build"),  # 4 GB before it was counted
    ("{{ ('%(a)9999s' * 100000) % {'a': ''} }}", "would build"),
    ("{{ ('x' * 2000).join('y' * 1000000)|length }}", "would build"),
    ("{{ ('y' * 1000000)|join('x' * 2000)|length }}", "would build"),
    ("{{ [1, 2]|dictsort }}", "failed on these messages"),  # an AttributeError escaped as a traceback
    ("{{ cycler().next() }}", "failed on these messages"),  # a RuntimeError likewise
])
def test_a_second_review_s_attacks_are_refused_quickly(template, says):
    """A security review of the budget: a deeply nested tuple's hash crashed the interpreter; values
    of shared references printed, compared or encoded at 2^60 items in one C call; big-integer
    arithmetic and format widths ran for minutes or took gigabytes before any count; filters raised
    exceptions that escaped as tracebacks."""
    import resource
    import time

    before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(InvalidArgumentError, match=says):
        ChatTemplate(template).render(HI)
    assert time.perf_counter() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 600 * 1024


@pytest.mark.parametrize("template", ["{% if true %}" * 101 + "x" + "{% endif %}" * 101,
                                      "{{ 'x'" + "|lower" * 210 + " }}", "{{ messages" + "[0]" * 210 + " }}",
                                      "{{ " + "1" * 5000 + " }}"])
def test_syntax_python_cannot_compile_is_a_template_error(template):
    """IndentationError, SyntaxError and ValueError escaped ChatTemplate() and so broke loading the
    model (which should still complete plain prompts)."""
    t = ChatTemplate(template)
    assert isinstance(t.error, ModelFormatError)


def test_deep_filter_chains_compile_in_linear_time():
    """22 KB of 180-deep filter chains took 45 s to compile (Jinja's constant folding retried every
    level); with folding off and nesting capped, a 256 KB template of chains compiles in seconds."""
    import time

    chain = "{{ ''" + "|lower" * 40 + " }}"
    t0 = time.perf_counter()
    t = ChatTemplate(chain * (200 * 1024 // len(chain)))
    assert t.error is None and time.perf_counter() - t0 < 20


@pytest.mark.parametrize("template, says", [
    ("{{ (1).to_bytes(2000000000, 'big')|length }}", "int.to_bytes"),  # rendered, 2 GB
    ("{{ (('x' * 1000000).encode() * 2000)|length }}", "str.encode"),
    ("{{ ('x' * 2000).translate({120: 'y' * 1000000})|length }}", "str.translate"),
    ("{{ ('{0}' * 2000).format('x' * 1000000)|length }}", "would build"),  # an argument used 2,000 times
    ("{{ (('%(a)s' * 2000) % {'a': 'x' * 1000000})|length }}", "would build"),
    ("{{ ('%(a)s' * 2000)|format(a='x' * 1000000) }}", "would build"),
    ("{{ ('%.500000000f' % 1.0)|length }}", "would build"),  # a precision is a width
    ("{{ '{:.500000000f}'.format(1.0)|length }}", "would build"),
    ("{{ ('x' * 500000)|replace('x', ['y' * 4000])|length }}", "would build"),  # a list as the new text
    ("{% set a = 'x' * 1000000 %}{% set s = a" + " ~ a" * 39 + " %}{{ [" + ", ".join(["s[::-1]"] * 50) + "]|length }}",
     "built more"),  # slices copy
    ("{{ ([[0]] * 200000)|sum(start=[])|length }}", "sum with a start"),  # quadratic list additions
    ("{{ ('x' * 100000)|list|sort(attribute='" + ".".join(["0"] * 5001) + "')|length }}", "attribute path"),
    ("{{ ([10 ** 1000] * 100000)|join|length }}", "would build|built more"),  # digits of big integers
    ("{% set n = 10 ** 1000 %}{{ ([n] * 200000)|string|length }}", "built more|would build"),
])
def test_a_third_review_s_attacks_are_refused_before_they_cost(template, says):
    """A third security round: bytes were never counted (int.to_bytes, str.encode); format and %
    counted widths but not an argument used many times, nor precisions; replace with a non-string
    new text, slices, big integers' digits, sum over lists and long attribute paths ran unchecked."""
    import resource
    import time

    before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(InvalidArgumentError, match=says):
        ChatTemplate(template).render(HI)
    assert time.perf_counter() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 600 * 1024


@pytest.mark.parametrize("name", ["urlize", "wordwrap", "batch", "slice"])
def test_filters_that_run_for_minutes_are_not_there(name):
    """urlize's regex backtracks quadratically, wordwrap is quadratic, batch and slice repeat a fill value:
    no chat template uses them; a template that does is a template error at load."""
    t = ChatTemplate("{{ messages|" + name + " }}")
    assert isinstance(t.error, ModelFormatError) and name in str(t.error)


def test_the_methods_real_templates_call_still_work():
    src = ("{% for m in messages %}{{ m['content'].strip().split(' ')|join('-') }}|{{ m.get('role') }}|"
           "{{ m.items()|list|length }}|{{ 'a,b'.rsplit(',', 1) }}|{{ 'x'.startswith('x') }}|{{ [1, 2].index(2) }}|"
           "{{ loop.cycle('odd', 'even') }}|{{ '{}-{}'.format(1, 'a') }}|{{ '%s!' % 'hi' }}{% endfor %}")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    want = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(src).render(messages=HI)
    assert ChatTemplate(src).render(HI) == want
