"""Tools and tool messages through admission's chat rendering: what transformers' apply_chat_template renders from
the same OpenAI-shaped conversation, and a clear INVALID_ARGUMENT for what no template can be given."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from protos import generation_pb2
from scheduler_service.admission import Admission, ModelLimits
from shared.errors import InvalidRequestError

# A template that describes tools, in the manner of the Hermes / Qwen 2.5 ones: the tools' JSON in the system
# turn, an assistant's calls with their arguments as objects, a tool's result under its call id.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }} {{ c.function.arguments.city }}"
    "</call>{% endfor %}{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tool_tokenizer(default_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def _admission(tok) -> Admission:
    return Admission(tok, ModelLimits(max_model_len=4096, vocab_size=len(tok)))


def _request(messages: list[generation_pb2.ChatMessage], tools: list[generation_pb2.Tool] | None = None
             ) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(messages=messages)
    req.chat_options.tools.extend(tools or [])
    return req


def _conversation() -> tuple[list[generation_pb2.ChatMessage], list[dict]]:
    """A turn that called a tool and got its answer, on the wire and as apply_chat_template takes it."""
    wire = [
        generation_pb2.ChatMessage(role="user", content="Weather in Paris?"),
        generation_pb2.ChatMessage(role="assistant", reasoning="Look it up.", tool_calls=[
            generation_pb2.ToolCall(id="call-1", name="get_weather", arguments='{"city": "Paris"}')]),
        generation_pb2.ChatMessage(role="tool", content="18 C, clear", tool_call_id="call-1"),
    ]
    template = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, clear", "tool_call_id": "call-1"},
    ]
    return wire, template


def test_tools_and_tool_messages_render_as_transformers_does(tool_tokenizer) -> None:
    wire, template = _conversation()
    tools = [generation_pb2.Tool(name="get_weather", description="The weather now", parameters=json.dumps(WEATHER))]
    got = _admission(tool_tokenizer).admit(_request(wire, tools)).prompt_token_ids
    text = tool_tokenizer.apply_chat_template(
        template, tools=[{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                                           "parameters": WEATHER}}],
        tokenize=False, add_generation_prompt=True)
    assert got == list(tool_tokenizer(text, add_special_tokens=False).input_ids)
    rendered = tool_tokenizer.decode(got)
    # The tools, the call's arguments as an object, and the result's call id all reached the template.
    assert '"name": "get_weather"' in rendered and '"city"' in rendered
    assert "<call id=call-1>get_weather Paris</call>" in rendered and "(answers call-1)" in rendered
    assert "<think>Look it up.</think>" in rendered


def test_a_template_without_tools_renders_the_conversation(admission_default) -> None:
    wire, _ = _conversation()
    tools = [generation_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER))]
    with_tools = admission_default.admit(_request(wire, tools)).prompt_token_ids
    assert with_tools == admission_default.admit(_request(wire)).prompt_token_ids
    assert "<|im_start|>tool\n18 C, clear<|im_end|>" in admission_default._tok.decode(with_tools)


@pytest.fixture(scope="module")
def admission_default(default_model_dir: Path) -> Admission:
    return _admission(AutoTokenizer.from_pretrained(default_model_dir))


def _call(**fields: str) -> generation_pb2.ToolCall:
    return generation_pb2.ToolCall(**{"id": "c", "name": "f", "arguments": "{}", **fields})


@pytest.mark.parametrize("messages, tools, message", [
    ([generation_pb2.ChatMessage(role="user", content="x", tool_calls=[_call()])], [],
     "messages[0].tool_calls: only assistant messages make tool calls, this one is 'user'"),
    ([generation_pb2.ChatMessage(role="tool", content="18 C")], [],
     "messages[0]: a tool message needs tool_call_id, the id of the call it answers"),
    ([generation_pb2.ChatMessage(role="user", content="x", reasoning="hmm")], [],
     "messages[0].reasoning: only assistant messages reason, this one is 'user'"),
    ([generation_pb2.ChatMessage(role="user", content="x", tool_call_id="c")], [],
     "messages[0].tool_call_id: only tool messages answer a call, this one is 'user'"),
    ([generation_pb2.ChatMessage(role="assistant", tool_calls=[_call(), _call(arguments="{city")])], [],
     "messages[0].tool_calls[1].arguments is not valid JSON"),
    ([generation_pb2.ChatMessage(role="assistant", tool_calls=[_call(arguments="[1]")])], [],
     "messages[0].tool_calls[0].arguments must be a JSON object, got list"),
    ([generation_pb2.ChatMessage(role="assistant", tool_calls=[_call(name="")])], [],
     "messages[0].tool_calls[0].name must not be empty"),
    ([generation_pb2.ChatMessage(role="user", content="x")],
     [generation_pb2.Tool(name="f"), generation_pb2.Tool(name="f")],
     "tools name 'f' more than once"),
    ([generation_pb2.ChatMessage(role="user", content="x")], [generation_pb2.Tool(name="")],
     "tools[0].name must not be empty"),
    ([generation_pb2.ChatMessage(role="user", content="x")], [generation_pb2.Tool(name="f", parameters="{")],
     "tools[0].parameters is not valid JSON"),
])
def test_what_cannot_be_rendered_is_named(admission_default: Admission, messages, tools, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        admission_default.admit(_request(messages, tools))
    # /tokenize renders through the same code.
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        admission_default.tokenize(generation_pb2.TokenizeRequest(
            messages=messages, chat_options=generation_pb2.ChatOptions(tools=tools)))


def test_a_template_that_refuses_the_conversation_is_an_invalid_argument(default_model_dir: Path) -> None:
    """Templates refuse what they cannot render (raise_exception), or fail on a field a message lacks: the caller's
    conversation, so INVALID_ARGUMENT with the template's words, not an internal error."""
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    wire, _ = _conversation()
    for template, words in [
        ("{% for m in messages %}{% if m.tool_calls and m.tool_calls | length > 0 %}"
         "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}{% endfor %}",
         "This model only supports single tool-calls at once!"),
        ("{% for m in messages %}{{ m.content }}{{ m.missing.field }}{% endfor %}", "'dict object' has no attribute"),
        ("{{ messages | length + messages[0].content }}", "unsupported operand type(s) for +"),
    ]:
        tok.chat_template = template
        with pytest.raises(InvalidRequestError, match=re.escape(f"messages cannot be rendered with the chat template: "
                                                                f"{words}")):
            _admission(tok).admit(_request(wire))


# A template that reads a variable of its own and documents, as Qwen 3's enable_thinking and RAG templates do.
KWARGS_TEMPLATE = (
    "{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is false %}<think></think>"
    "{% endif %}{% endif %}"
)


def test_template_kwargs_reach_the_template_as_transformers_passes_them(default_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = KWARGS_TEMPLATE
    admission = _admission(tok)
    messages = [generation_pb2.ChatMessage(role="user", content="Hi")]
    kwargs = {"enable_thinking": False, "documents": [{"title": "A", "text": "alpha"}]}
    req = _request(messages)
    req.chat_options.template_kwargs = json.dumps(kwargs)
    got = tok.decode(admission.admit(req).prompt_token_ids)
    assert got == tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True, **kwargs)
    assert got.startswith("[doc A: alpha]") and got.endswith("<think></think>")
    assert not tok.decode(admission.admit(_request(messages)).prompt_token_ids).endswith("<think></think>")


@pytest.mark.parametrize("kwargs, message", [
    ('{"tokenize": true}', "chat_template_kwargs.tokenize is a rendering option, not a template variable"),
    ('{"add_generation_prompt": false, "x": 1}',
     "chat_template_kwargs.add_generation_prompt is a rendering option, not a template variable: set the request's "
     "own add_generation_prompt"),
    ('{"tools": []}', "set the request's own tools"),
    ('{"enable', "chat_template_kwargs is not valid JSON"),
    # transformers checks documents' shape; a template may compute with a variable of the wrong type.
    ('{"documents": [1]}', "Documents should be a list of dicts with 'title' and 'text' keys!"),
    ("[1]", "chat_template_kwargs must be a JSON object, got list"),
])
def test_template_kwargs_that_are_no_template_variables_are_refused(admission_default: Admission, kwargs: str,
                                                                     message: str) -> None:
    req = _request([generation_pb2.ChatMessage(role="user", content="Hi")])
    req.chat_options.template_kwargs = kwargs
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        admission_default.admit(req)
