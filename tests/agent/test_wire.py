"""The scripted model server's wire format, proven with the official SDKs
parsing strictly (`_strict_response_validation=True`, no retries): what the
agent loop's tests rely on is what the real clients accept."""

import json

import anthropic
import openai
import pytest

TOOLS_ANTHROPIC = [
    {
        "name": "run_stage",
        "description": "Run commands in a stage forked from a snapshot.",
        "input_schema": {
            "type": "object",
            "properties": {"snapshot_id": {"type": "string"}, "commands": {"type": "array"}},
            "required": ["snapshot_id"],
        },
    }
]
TOOLS_OPENAI = [
    {"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in TOOLS_ANTHROPIC
]

SCRIPT = {
    "turns": [
        {"text": "I will run it.", "tool_calls": [{"name": "run_stage", "arguments": {"snapshot_id": "seed", "commands": ["echo 1"]}}]},
        {
            "tool_calls": [
                {
                    "name": "run_stage",
                    "arguments": {
                        "snapshot_id": "{{results[-1].snapshots[0].id}}",
                        "commands": ["echo {{results[0].exit}}"],
                        "all": "{{results[0]}}",
                    },
                }
            ]
        },
        {"text": "Done: the winner is X.", "stop": "end_turn", "usage": {"input": 120, "output": 30}},
    ]
}

RESULT = {"exit": 0, "snapshots": [{"id": "snap-42"}]}


def claude(server, **kw):
    return anthropic.Anthropic(
        api_key="test-key", base_url=server.url, max_retries=0, _strict_response_validation=True, **kw
    )


def gpt(server, **kw):
    return openai.OpenAI(
        api_key="test-key", base_url=server.url + "/v1", max_retries=0, _strict_response_validation=True, **kw
    )


def test_anthropic_conversation_with_tools_parses_strictly_and_fills_placeholders(scripted):
    server = scripted(SCRIPT)
    client = claude(server)
    messages = [{"role": "user", "content": "Find the winner."}]
    first = client.messages.create(model="claude-test", max_tokens=1024, tools=TOOLS_ANTHROPIC, messages=messages)
    assert first.id == "msg_t0" and first.model == "claude-test" and first.stop_reason == "tool_use"
    text, call = first.content
    assert isinstance(text, anthropic.types.TextBlock) and text.text == "I will run it."
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert (call.id, call.name, call.input) == ("toolu_t0_0", "run_stage", {"snapshot_id": "seed", "commands": ["echo 1"]})
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(RESULT)}]},
    ]
    second = client.messages.create(model="claude-test", max_tokens=1024, tools=TOOLS_ANTHROPIC, messages=messages)
    (call2,) = second.content
    assert isinstance(call2, anthropic.types.ToolUseBlock) and call2.id == "toolu_t1_0"
    assert call2.input == {"snapshot_id": "snap-42", "commands": ["echo 0"], "all": RESULT}

    # Result content as text blocks is read the same way.
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in second.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call2.id, "content": [{"type": "text", "text": "ok"}]}]},
    ]
    last = client.messages.create(model="claude-test", max_tokens=1024, tools=TOOLS_ANTHROPIC, messages=messages)
    assert last.stop_reason == "end_turn" and last.content[0].text == "Done: the winner is X."
    assert (last.usage.input_tokens, last.usage.output_tokens) == (120, 30)

    # Asking for turn 0 again (a restarted client) gets the same reply.
    again = client.messages.create(model="claude-test", max_tokens=1024, tools=TOOLS_ANTHROPIC, messages=messages[:1])
    assert again.model_dump() == first.model_dump()
    assert [r["turn"] for r in server.requests()] == [0, 1, 2, 0]
    assert server.violations() == []


def test_openai_conversation_with_tools_parses_strictly_and_fills_placeholders(scripted):
    server = scripted(SCRIPT)
    client = gpt(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find the winner."}]
    first = client.chat.completions.create(model="gpt-test", tools=TOOLS_OPENAI, messages=messages)
    assert first.id == "chatcmpl-t0" and first.model == "gpt-test"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will run it."
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_t0_0", "function", "run_stage")
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"snapshot_id": "seed", "commands": ["echo 1"]}
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens > 0

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)},
    ]
    second = client.chat.completions.create(model="gpt-test", tools=TOOLS_OPENAI, messages=messages)
    (call2,) = second.choices[0].message.tool_calls
    assert second.choices[0].message.content is None
    assert json.loads(call2.function.arguments) == {"snapshot_id": "snap-42", "commands": ["echo 0"], "all": RESULT}

    messages += [
        second.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call2.id, "content": "ok"},
    ]
    last = client.chat.completions.create(model="gpt-test", tools=TOOLS_OPENAI, messages=messages)
    assert last.choices[0].finish_reason == "stop" and last.choices[0].message.content == "Done: the winner is X."
    assert last.choices[0].message.tool_calls is None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (120, 30, 150)
    assert server.violations() == []


FAILING = {
    "turns": [
        {
            "text": "finally",
            "fail": [{"status": 429, "retry_after": 3}, {"status": 503}, {"status": 500}, {"status": 529}, {"delay_ms": 2000}],
        }
    ]
}


def test_anthropic_failures_surface_as_the_sdks_errors(scripted):
    server = scripted(FAILING)
    client = claude(server)
    ask = lambda c=client: c.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.RateLimitError) as limited:
        ask()
    assert limited.value.status_code == 429 and limited.value.response.headers["retry-after"] == "3"
    assert limited.value.body["error"]["type"] == "rate_limit_error"
    with pytest.raises(anthropic.InternalServerError) as unavailable:
        ask()
    assert unavailable.value.status_code == 503
    with pytest.raises(anthropic.InternalServerError) as broken:
        ask()
    assert broken.value.status_code == 500 and broken.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        ask()
    assert overloaded.value.status_code == 529 and overloaded.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.APITimeoutError):
        ask(claude(server, timeout=0.3))
    # Each failure was served once; the next request gets the reply.
    assert ask().content[0].text == "finally"
    assert server.violations() == []


def test_openai_failures_surface_as_the_sdks_errors(scripted):
    server = scripted(FAILING)
    client = gpt(server)
    ask = lambda c=client: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.RateLimitError) as limited:
        ask()
    assert limited.value.status_code == 429 and limited.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.InternalServerError) as unavailable:
        ask()
    assert unavailable.value.status_code == 503
    with pytest.raises(openai.APIStatusError) as broken:
        ask()
    assert broken.value.status_code == 500
    with pytest.raises(openai.InternalServerError):
        ask()
    with pytest.raises(openai.APITimeoutError):
        ask(gpt(server, timeout=0.3))
    assert ask().choices[0].message.content == "finally"


def test_an_unanswered_tool_use_is_a_bad_request_and_a_recorded_violation(scripted):
    server = scripted(SCRIPT)
    client = claude(server)
    first = client.messages.create(model="m", max_tokens=100, tools=TOOLS_ANTHROPIC, messages=[{"role": "user", "content": "go"}])
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": "I forgot to send the tool result."},
    ]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=100, tools=TOOLS_ANTHROPIC, messages=history)
    assert "toolu_t0_0" in refused.value.message and "not answered" in refused.value.message
    (violation,) = server.violations()
    assert "anthropic request 2 (turn 1)" in violation and "toolu_t0_0" in violation
    assert [r["answered"] for r in server.requests()] == [200, 400]


def test_an_unanswered_tool_call_and_a_missing_turn_are_bad_requests_for_openai(scripted):
    server = scripted(SCRIPT)
    client = gpt(server)
    first = client.chat.completions.create(model="m", tools=TOOLS_OPENAI, messages=[{"role": "user", "content": "go"}])
    history = [{"role": "user", "content": "go"}, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", tools=TOOLS_OPENAI, messages=history)
    assert "call_t0_0" in refused.value.message
    beyond = [{"role": "user", "content": "a"}] + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}] * 3
    with pytest.raises(openai.BadRequestError) as missing:
        client.chat.completions.create(model="m", messages=beyond)
    assert "the script has no turn 3" in missing.value.message
    assert len(server.violations()) == 2


def test_raw_arguments_arrive_verbatim_on_openai_and_wrapped_on_anthropic(scripted):
    server = scripted({"turns": [{"tool_calls": [{"name": "run_stage", "raw_arguments": "{not json"}]}]})
    call = gpt(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}]).choices[0].message.tool_calls[0]
    assert call.function.arguments == "{not json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    reply = claude(server).messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "go"}])
    assert reply.content[0].input == {"_raw": "{not json"}
    assert server.violations() == []
