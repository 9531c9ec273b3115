"""Chat templates: the study's prompt, real templates as transformers renders them, and hostile
templates refused within their budget."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qllama.errors import ChatTemplateError, QllamaError
from qllama.gguf.reader import read_gguf
from qllama.runtime.chat_template import (
    ChatTemplate,
    Limits,
    encode_chat,
    render_chat,
)
from qllama.runtime.template_sandbox import check_jinja2_version
from qllama.runtime.tokenizer import Tokenizer
from qllama.synthetic import CHAT_TEMPLATE, write_tiny_llama

STUDY_MESSAGES = [{"role": "user", "content": "Explain how a CPU cache works."}]
SMOLLM2_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nExplain how a CPU cache works.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
STUDY_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 36971, 638, 253, 17756, 13842, 1806, 30, 2, 198, 1, 520,
    9531, 198,
]  # fmt: skip


def test_jinja2_version_is_checked() -> None:
    check_jinja2_version(jinja2.__version__)  # the installed one passes
    check_jinja2_version("3.1.6")
    check_jinja2_version("3.2.0.dev1")
    for old in ("3.1.5", "3.0.3", "2.11.3"):
        with pytest.raises(ImportError, match="jinja2 >= 3.1.6"):
            check_jinja2_version(old)


# --- the study's prompt ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_file(smollm2_path: Path):  # type: ignore[no-untyped-def]
    return read_gguf(smollm2_path)


@pytest.mark.model
def test_study_prompt_is_37_tokens(smollm2_file) -> None:  # type: ignore[no-untyped-def]
    template = smollm2_file.get("tokenizer.chat_template")
    tok = Tokenizer.from_gguf(smollm2_file)
    assert render_chat(template, STUDY_MESSAGES) == SMOLLM2_TEXT
    ids = encode_chat(tok, template, STUDY_MESSAGES)
    assert len(ids) == 37
    assert ids == STUDY_IDS
    assert ChatTemplate(template, tok).encode(STUDY_MESSAGES) == STUDY_IDS
    assert render_chat(template, STUDY_MESSAGES, add_generation_prompt=False) == SMOLLM2_TEXT[:-22]


@pytest.mark.model
def test_study_prompt_equals_transformers(smollm2_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    hf = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name
    )
    ids = hf.apply_chat_template(STUDY_MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == STUDY_IDS


def test_synthetic_template_encodes_special_tokens(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "tiny.gguf")
    f = read_gguf(tmp_path / "tiny.gguf")
    tok = Tokenizer.from_gguf(f)
    chat = ChatTemplate(f.get("tokenizer.chat_template"), tok)
    ids = chat.encode([{"role": "user", "content": "the"}])
    start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2  # system, user, assistant turns
    assert tok.decode(ids) == chat.render([{"role": "user", "content": "the"}])


def test_chat_template_without_tokenizer_cannot_encode() -> None:
    with pytest.raises(ChatTemplateError, match="no tokenizer"):
        ChatTemplate(CHAT_TEMPLATE).encode(STUDY_MESSAGES)


def test_keywords_reach_the_template() -> None:
    t = "{{ bos_token }}|{{ eos_token }}|{{ tools|length }}|{{ custom }}"
    t += "|{{ add_generation_prompt }}"
    out = render_chat(
        t, [], bos_token="<s>", eos_token="</s>", tools=[{"a": 1}, {"b": 2}], custom="x"
    )
    assert out == "<s>|</s>|2|x|True"
    assert render_chat(t, [], add_generation_prompt=False).endswith("|False")


def test_odd_message_values_become_placeholders() -> None:
    msgs = [{"role": "user", "content": np.zeros(3), "n": np.int64(4), "ok": np.bool_(True)}]
    out = render_chat(
        "{{ messages[0].content }} {{ messages[0].n + 1 }} {{ messages[0].ok }}", msgs
    )
    assert out == "<ndarray> 5 True"


# --- real templates render as transformers renders them ---------------------------------------

QWEN25 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions.\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

LLAMA31 = """\
{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

EVERYTHING = """\
{%- set ns = namespace(n=0, last_user=-1) %}
{%- macro render(m) -%}<{{ m.role|upper }}>{{ m.content|trim }}{%- endmacro %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
  {{- render(m) ~ ' #' ~ ns.n }}
  {%- if loop.index0 == ns.last_user %}{{ ' (last user)' }}{% endif %}
  {%- if ns.n > 10 %}{% break %}{% endif %}
{%- endfor %}
{{- '\\nroles: ' + messages|map(attribute='role')|unique|join(',') }}
{{- '\\n%d messages, %s' % (messages|length, 'ok') }}
{%- set d = dict(a=1, b=[1, 2], c={'x': 'y'}) %}{{ '\\n' ~ d|tojson }}
{%- for k, v in d|items %}{{ ' ' ~ k ~ '=' ~ v|string }}{% endfor %}
{{- '\\n' ~ (messages|selectattr('role', 'equalto', 'user')|list|length) ~ ' users' }}
{{- '\\n' ~ ['x', 'y']|join('-') ~ (1, 2)|sum ~ ('a' * 3) ~ (2 ** 10) ~ '{}!'.format('fmt') }}
{{- '\\n' ~ messages[-1].content[:5]|center(9) ~ '|' ~ 'a,b'.split(',')|reverse|join }}
"""  # noqa: E501

CONVERSATION = [
    {"role": "system", "content": "  You are terse.  "},
    {"role": "user", "content": "What's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And the weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "user", "content": "Thanks 🎉"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "str"}}}]
ALTERNATING = [m for m in CONVERSATION[1:4] if m["role"] in ("user", "assistant")]


def stock_render(template: str, messages: list, **kwargs) -> str:  # type: ignore[type-arg]
    """The same template in a plain sandbox with no budget (transformers' environment)."""

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    import json

    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template).render(messages=messages, **kwargs)


REAL = [
    ("chatml", CHAT_TEMPLATE, CONVERSATION[1:4], {}),
    ("qwen2.5", QWEN25, CONVERSATION, {}),
    ("qwen2.5-tools", QWEN25, CONVERSATION, {"tools": TOOLS}),
    ("llama3.1", LLAMA31, CONVERSATION, {"bos_token": "<|begin_of_text|>"}),
    ("llama3.1-tools", LLAMA31, CONVERSATION, {"bos_token": "", "tools": TOOLS, "tools_in_user_message": False}),  # noqa: E501
    ("mistral", MISTRAL, ALTERNATING, {"bos_token": "<s>", "eos_token": "</s>"}),
    ("everything", EVERYTHING, CONVERSATION, {}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "messages", "kwargs"), [r[1:] for r in REAL], ids=[r[0] for r in REAL]
)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_real_templates_render_as_without_limits(
    template: str,
    messages: list,
    kwargs: dict,
    generation_prompt: bool,  # type: ignore[type-arg]
) -> None:
    ours = render_chat(template, messages, add_generation_prompt=generation_prompt, **kwargs)
    assert ours == stock_render(
        template, messages, add_generation_prompt=generation_prompt, **kwargs
    )
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return
    (theirs,), _ = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=generation_prompt, **kwargs
    )
    assert ours == theirs


def test_template_errors_are_reported() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(MISTRAL, CONVERSATION[1:], bos_token="", eos_token="")
    many_calls = [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}] * 2}]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        render_chat(LLAMA31, many_calls, bos_token="")


# --- hostile templates -----------------------------------------------------------------------

HOSTILE = [
    # server-side template injection: refused by the sandbox
    ("class", "{{ ''.__class__ }}", "attribute '__class__' of 'str' object is unsafe"),
    ("mro", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("globals", "{{ cycler.__init__.__globals__.os.popen('id').read() }}", "'__init__'"),
    ("attr-format", "{{ '{0.__class__}'|attr('format')('x') }}", "'__class__'"),
    ("format-globals", "{{ '{0.__init__.__globals__}'.format(cycler) }}", "'__init__'"),
    ("format-map", "{{ '{x.__class__}'.format_map({'x': 1}) }}", "'__class__'"),
    ("getitem-dunder", "{{ ''['__class__'] }}", "unsafe"),
    ("self", "{{ self.__init__.__globals__ }}", "unsafe"),
    ("mutation", "{% set l = [] %}{{ l.append(1) }}", "attribute 'append' of 'list'"),
    ("dict-mutation", "{% set d = {} %}{{ d.update(a=1) }}", "'update'"),
    ("namespace-dunder", "{% set ns = namespace(__class__=1) %}", "underscore"),
    ("lipsum", "{{ lipsum(10**6) }}", "'lipsum' is undefined"),
    ("include", "{% include 'x' %}", "no loader"),
    # resource exhaustion: refused within the budget
    ("range-1e9", "{% for i in range(10**9) %}{% endfor %}", "range of 1000000000 items"),
    ("nested-range", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "step budget|time budget"),  # noqa: E501
    ("nested-list", "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}", "step budget|time budget"),  # noqa: E501
    ("string-repetition", "{{ 'a' * 10**10 }}", "repetition could build a value of weight 10000000000"),  # noqa: E501
    ("string-repetition-2", "{% set x = 'a' * 1000000 %}{{ x * 1000 }}", "repetition"),
    ("list-repetition", "{{ [1, 2] * 10**9 }}", "repetition"),
    ("list-repetition-2", "{% set l = [0] * 100000 %}{{ (l * 100000)|length }}", "repetition"),
    ("recursive-macro", "{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "recursion"),
    ("fan-out-macro", "{% macro m(n) %}{% if n < 40 %}{{ m(n+1) }}{{ m(n+1) }}{% endif %}{% endmacro %}{{ m(0) }}", "step budget|time budget"),  # noqa: E501
    ("raise-exception", "{{ raise_exception('x') }}", "the template raised an error: x"),
    ("power", "{{ 2 ** 1000000000 }}", "power over 4096 bits"),
    ("doubling", "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "concatenation"),  # noqa: E501
    ("doubling-tilde", "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),  # noqa: E501
    ("shared-list", "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}", "a literal would weigh"),  # noqa: E501
    ("center-filter", "{{ 'a'|center(10**10) }}", "argument 1 of filter 'center'"),
    ("center-method", "{{ 'a'.center(10**10) }}", "argument 0 of center"),
    ("ljust", "{{ 'a'.ljust(1000000000) }}", "ljust"),
    ("replace", "{% set x = 'a' * 100000 %}{{ x.replace('a', 'b' * 100000) }}", "replace"),
    ("replace-filter", "{% set x = 'a' * 100000 %}{{ x|replace('', 'b' * 1000) }}", "replace"),
    # small inputs, a large product: the guard, not the time budget, must end these
    ("join-filter", "{{ range(1000)|map('string')|join('x' * 10000) }}", "join"),
    ("join-method", "{{ ('x' * 10000).join(range(1000)|map('string')) }}", "join"),
    ("printf-width", "{{ '%*s' % (10**9, 'a') }}", "% formatting"),
    ("printf-fields", "{{ ('%1000000s' * 1000) % ((1,) * 1000) }}", "% formatting"),
    ("format-width", "{{ '{:>1000000000}'.format('a') }}", "format"),
    ("indent", "{% set x = '\\n' * 100000 %}{{ x|indent('y' * 100000) }}", "indent"),
    ("tojson-indent", "{{ [[[[1]]]]|tojson(indent=10**9) }}", "tojson"),
    ("expandtabs", "{{ ('\\t' * 100000).expandtabs(100000) }}", "expandtabs"),
    ("wordwrap", "{{ ('a' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}", "wordwrap"),
    ("translate", "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", "translate"),
    ("to-bytes", "{{ (1).to_bytes(10**9, 'big') }}", "to_bytes"),
    ("batch", "{{ [1]|batch(10**6, fill_with='x' * 1000000)|list }}", "budget"),
    ("slice", "{{ [1]|slice(10**9)|list }}", "slice"),
    ("strftime", "{{ strftime_now('%c' * 100000) }}", "strftime_now"),
    ("output", "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output ran past 1048576"),  # noqa: E501
    ("loop-length", "{% for i in range(100000) %}{% for j in range(100000) %}{{ loop.length }}{% endfor %}{% endfor %}", "budget"),  # noqa: E501
    # plain errors
    ("syntax", "{% for %}", "syntax error on line 1"),
    ("undefined", "{{ foo.bar.baz }}", "UndefinedError: 'foo' is undefined"),
    ("division", "{{ 1 / 0 }}", "ZeroDivisionError"),
    ("type", "{{ 1 + 'a' }}", "TypeError"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_template_is_refused_quickly(template: str, message: str) -> None:
    # the budgets (steps, sizes, 2 s of wall clock) end it; how fast is a benchmark's business,
    # so where a loaded machine may reach the time budget before the step budget, either counts
    with pytest.raises(ChatTemplateError, match=message):
        render_chat(template, STUDY_MESSAGES)
    assert render_chat(CHAT_TEMPLATE, STUDY_MESSAGES).endswith("assistant\n")  # still fine


def test_chat_template_error_is_a_value_error() -> None:
    assert issubclass(ChatTemplateError, QllamaError) and issubclass(ChatTemplateError, ValueError)


def test_limits_are_settable() -> None:
    with pytest.raises(ChatTemplateError, match="output ran past 10 characters"):
        render_chat("{{ 'x' * 11 }}", [], limits=Limits(max_output=10))
    with pytest.raises(ChatTemplateError, match="step budget of 50"):
        render_chat("{% for i in range(100) %}{% endfor %}", [], limits=Limits(max_steps=50))
    with pytest.raises(ChatTemplateError, match="range of 11 items"):
        render_chat("{{ range(11)|list }}", [], limits=Limits(max_range=10))
    busy = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="time budget of 0.05 s"):
        render_chat(busy, [], limits=Limits(max_seconds=0.05, max_steps=10**12))
    chat = ChatTemplate("{{ 'x' * 11 }}").with_limits(max_output=10)
    with pytest.raises(ChatTemplateError, match="output"):
        chat.render([])
    assert ChatTemplate("{{ 'x' * 11 }}").render([]) == "x" * 11


def test_template_size_is_capped() -> None:
    with pytest.raises(ChatTemplateError, match="over the limit of 100"):
        render_chat("x" * 101, [], limits=Limits(max_template_chars=100))
    with pytest.raises(ChatTemplateError, match="must be a string"):
        render_chat(None, [])  # type: ignore[arg-type]


def test_deeply_nested_messages_are_refused() -> None:
    deep: list = []  # type: ignore[type-arg]
    for _ in range(300):
        deep = [deep]
    with pytest.raises(ChatTemplateError, match="nested deeper"):
        render_chat("{{ messages }}", [{"role": "user", "content": deep}])


def test_large_numbers_as_data_are_fine() -> None:
    """Integer caps apply to widths and counts, not to numbers a template merely prints."""
    t = "{{ '%d' % 20240131 }} {{ '{}'.format(1234567) }} {{ '%d'|format(12345678) }} "
    t += "{{ dict(a=10**7).a }} {{ 10**20 }}"
    assert render_chat(t, []) == "20240131 1234567 12345678 10000000 100000000000000000000"


# --- the families' own templates (llama.cpp's models/templates) --------------------------------

# The templates and conversations are tests/conformance/chats.py's; tests/peers/
# test_chat_templates.py renders the same with llama.cpp (its Jinja and C engines) and
# compares the ids with llama.cpp's tokenizer. Here: what holds without llama.cpp's code.


@pytest.fixture(scope="module")
def llama_cpp_models() -> Path:
    """llama.cpp's models folder (templates, vocabularies) from the cached sdist."""
    from conformance.sources import Unreachable, llama_cpp_source

    try:
        return llama_cpp_source() / "models"
    except Unreachable as e:
        pytest.skip(str(e))


def _family_cases() -> list[tuple[str, str]]:
    from conformance.chats import CONVERSATIONS, FAMILIES

    return [(f, c) for f in FAMILIES for c in CONVERSATIONS]


@pytest.mark.parametrize(("family", "conversation"), _family_cases())
def test_family_templates_render_as_transformers(
    llama_cpp_models: Path, family: str, conversation: str
) -> None:
    """Every family's real template, every conversation: qllama's text is transformers' (the
    Jinja reference), including the refusals the template raises itself."""
    from conformance.chats import CONVERSATIONS, KWARGS, template_path

    render_jinja_template = pytest.importorskip(
        "transformers.utils.chat_template_utils"
    ).render_jinja_template
    source = template_path(llama_cpp_models, family).read_text()
    messages, generation = CONVERSATIONS[conversation]
    tokens = {"bos_token": "<s>", "eos_token": "</s>", **KWARGS}
    try:
        (theirs,), _ = render_jinja_template(
            [messages], chat_template=source, add_generation_prompt=generation, **tokens
        )
    except jinja2.TemplateError as e:  # the template's own raise_exception
        with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
            render_chat(source, messages, add_generation_prompt=generation, **tokens)
        return
    assert render_chat(source, messages, add_generation_prompt=generation, **tokens) == theirs


# The "system" conversation as each family's template writes it (bos_token "<s>", eos_token
# "</s>"): Llama 3 trims every message and opens with its dated system turn; ChatML keeps the
# text as given; Phi-3.5 puts each role tag on its own line; Mistral Nemo moves the system text
# into the last user turn; Gemma 2 refuses a system message.
SYSTEM_TEXTS = {
    "llama3.1": (
        "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nHello, world \n  ok?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "Hi! 🎉 l'été<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "qwen2.5": (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hello, world \n  ok?"
        "<|im_end|>\n<|im_start|>assistant\nHi! 🎉 l'été<|im_end|>\n<|im_start|>user\nBye\n\n"
        "<|im_end|>\n<|im_start|>assistant\n"
    ),
    "phi3.5": (
        "<|system|>\nBe brief.<|end|>\n<|user|>\n Hello, world \n  ok?<|end|>\n<|assistant|>\n"
        "Hi! 🎉 l'été<|end|>\n<|user|>\nBye\n\n<|end|>\n<|assistant|>\n"
    ),
    "mistral-nemo": "<s>[INST] Hello, world \n  ok?[/INST]Hi! 🎉 l'été</s>[INST]Be brief.\n\nBye\n\n[/INST]",  # noqa: E501
}
SYSTEM_TEXTS["llama3.2"] = SYSTEM_TEXTS["llama3.1"]  # 3.2 differs in tool calls only
SYSTEM_TEXTS["qwen3"] = SYSTEM_TEXTS["qwen2.5"]  # Qwen3 adds no default system prompt


@pytest.mark.parametrize("family", [*SYSTEM_TEXTS, "gemma2"])
def test_family_system_conversation_is_pinned(llama_cpp_models: Path, family: str) -> None:
    from conformance.chats import CONVERSATIONS, KWARGS, template_path

    source = template_path(llama_cpp_models, family).read_text()
    messages, generation = CONVERSATIONS["system"]
    tokens = {"bos_token": "<s>", "eos_token": "</s>", **KWARGS}
    if family == "gemma2":
        with pytest.raises(ChatTemplateError, match="System role not supported"):
            render_chat(source, messages, add_generation_prompt=generation, **tokens)
        return
    assert (
        render_chat(source, messages, add_generation_prompt=generation, **tokens)
        == (SYSTEM_TEXTS[family])
    )


# llama.cpp's ids of the "system" conversation, each family's template and real vocabulary
# (llama_tokenize, special tokens parsed; tests/peers/test_chat_templates.py recomputes them).
# Phi-3's chat tokens eat the whitespace after them (llama.cpp's rule for models named
# phi-3/phi3, Phi-3's rstrip): "<|user|>\nHi" is <|user|> then "▁Hi", without the newline.
SYSTEM_IDS = {
    ("llama3.1", "llama-bpe"): [
        128000, 128006, 9125, 128007, 271, 38766, 1303, 33025, 2696, 25, 6790, 220, 2366, 18,
        198, 15724, 2696, 25, 220, 1627, 10263, 220, 2366, 19, 271, 3513, 10015, 13, 128009,
        128006, 882, 128007, 271, 9906, 11, 1917, 720, 220, 5509, 30, 128009, 128006, 78191,
        128007, 271, 13347, 0, 11410, 236, 231, 326, 6, 39883, 128009, 128006, 882, 128007, 271,
        1383, 68, 128009, 128006, 78191, 128007, 271,
    ],
    ("qwen2.5", "qwen2"): [
        151644, 8948, 198, 3430, 9814, 13, 151645, 198, 151644, 872, 198, 21927, 11, 1879, 715,
        220, 5394, 30, 151645, 198, 151644, 77091, 198, 13048, 0, 11162, 236, 231, 326, 6, 38783,
        151645, 198, 151644, 872, 198, 1359, 68, 271, 151645, 198, 151644, 77091, 198,
    ],
    ("phi3.5", "phi-3"): [
        32006, 1522, 11473, 29889, 32007, 32010, 15043, 29892, 3186, 29871, 13, 29871, 3431,
        29973, 32007, 32001, 6324, 29991, 29871, 243, 162, 145, 140, 301, 29915, 7342, 32007,
        32010, 2648, 29872, 13, 13, 32007, 32001,
    ],
}  # fmt: skip


@pytest.mark.parametrize(("family", "vocab"), SYSTEM_IDS, ids=[f for f, _ in SYSTEM_IDS])
def test_family_prompt_ids_are_llama_cpps(llama_cpp_models: Path, family: str, vocab: str) -> None:
    from conformance.chats import CONVERSATIONS, KWARGS, template_path

    tok = Tokenizer.from_gguf(llama_cpp_models / f"ggml-vocab-{vocab}.gguf")
    chat = ChatTemplate(template_path(llama_cpp_models, family).read_text(), tok)
    messages, generation = CONVERSATIONS["system"]
    ids = chat.encode(messages, add_generation_prompt=generation, **KWARGS)
    assert ids == SYSTEM_IDS[family, vocab]


def test_phi3_strip_rule_follows_the_model_name(llama_cpp_models: Path) -> None:
    """llama.cpp strips the whitespace after Phi-3's chat tokens because of the file's
    general.name (phi-3 or phi3, any case), not its tokens: the same vocabulary under another
    name keeps the newline, as llama.cpp then does."""
    from qllama.ggml_types import ValueType
    from qllama.gguf.reader import GGUFValue

    f = read_gguf(llama_cpp_models / "ggml-vocab-phi-3.gguf")
    text = "<|user|>\nHi<|end|>\n"
    named = Tokenizer.from_metadata(f.kv)
    renamed = Tokenizer.from_metadata({**f.kv, "general.name": GGUFValue(ValueType.STRING, "tiny")})
    f.close()
    user, end = named.token_id("<|user|>"), named.token_id("<|end|>")
    stripped = named.encode(text, add_bos=False)
    kept = renamed.encode(text, add_bos=False)
    assert stripped[0] == user and stripped[-1] == end  # nothing after <|end|>
    assert kept[-1] != end and len(kept) > len(stripped)  # the newlines stay
    assert named.encode("Hi", add_bos=False) == renamed.encode("Hi", add_bos=False)


LAZY = """
import sys

import qllama
from qllama.synthetic import write_tiny_llama

write_tiny_llama(sys.argv[1])
model = qllama.load(sys.argv[1])
print("jinja2" in sys.modules)
model.apply_chat_template([{"role": "user", "content": "hi"}])
print("jinja2" in sys.modules)
"""


def test_jinja2_is_imported_with_the_first_render(tmp_path):
    """A process that only computes never loads jinja2 (7 MB resident)."""
    path = str(tmp_path / "tiny.gguf")
    run = subprocess.run([sys.executable, "-c", LAZY, path], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "True"]
