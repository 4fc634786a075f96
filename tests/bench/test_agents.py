"""bench/agents.py's pure parts, without a server: judging a run from the calls its tools
executed, what counts as a malformed call, the per-step arithmetic (prefilled, new from the
server's token counts, the previous reply as held, the 1.1x goal at its boundary), the
conversation a step renders (Chat Completions' own, a Responses chain's), reading a step from a
Chat Completions or Responses stream, and the recording transport on a mocked server."""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any

import httpx2
import pytest

from kvchat.bench.agent_steps import (
    GOAL,
    Conversation,
    Counters,
    Exchange,
    ModelCall,
    Recorder,
    Step,
    TokenCounts,
    chat_step,
    conversation,
    cut_replies,
    held_reply,
    is_generated,
    meets_goal,
    new_by_completion,
    new_tokens,
    ratio,
    responses_step,
    token_counts,
)
from kvchat.bench.agent_tasks import (
    SCHEMAS,
    TASKS,
    Call,
    Requirement,
    degrees,
    judge,
    malformed,
    missing,
)
from kvchat.bench.agents import calls_cell, findings, later_steps, repeat_guard

TASK = {t.name: t for t in TASKS}


# -- judging ---------------------------------------------------------------------------------------


def test_a_requirement_is_met_by_its_tool_naming_the_value_as_a_whole_word() -> None:
    paris = Requirement("get_weather", "city", ("paris",))
    assert paris.met_by(Call("get_weather", {"city": "Paris"}))
    assert paris.met_by(Call("get_weather", {"city": "paris, France"}))
    assert not paris.met_by(Call("get_weather", {"city": "Parisian quarter"}))
    assert not paris.met_by(Call("get_time", {"city": "Paris"}))
    assert not paris.met_by(Call("get_weather", {"place": "Paris"}))
    celsius = Requirement("convert_units", "from_unit", ("celsius", "c"))
    assert celsius.met_by(Call("convert_units", {"from_unit": "°C"}))
    assert not celsius.met_by(Call("convert_units", {"from_unit": "cm"}))


def test_a_task_is_completed_with_every_required_call_and_a_final_output() -> None:
    task = TASK["two_populations"]
    canada = Call("lookup_population", {"place": "Canada"})
    japan = Call("lookup_population", {"place": "Japan"})
    assert judge(task, [japan, canada], "Canada 40.1 million, Japan 124.5 million")
    assert judge(task, [canada, canada, japan], "")  # an empty answer is still an answer
    assert not judge(task, [canada, japan], None)  # max_turns or an error: no final output
    assert not judge(task, [canada, canada], "done")
    assert [str(r) for r in missing(task, [canada])] == ["lookup_population(place=japan)"]
    assert len(missing(task, [])) == len(task.required)


def test_the_chained_task_needs_the_temperature_the_weather_tool_gave() -> None:
    task = TASK["weather_then_convert"]
    weather = Call("get_weather", {"city": "Berlin"})
    right = float(degrees("Berlin"))
    convert = Call("convert_units", {"value": right, "from_unit": "celsius", "to_unit": "F"})
    assert judge(task, [weather, convert], "ok")
    wrong = Call("convert_units", {"value": right + 1, "from_unit": "celsius", "to_unit": "F"})
    assert [r.argument for r in missing(task, [weather, wrong])] == ["value"]


def test_every_task_needs_2_to_6_calls_of_offered_tools() -> None:
    assert {t.num_calls for t in TASKS} >= {2, 6}
    for task in TASKS:
        assert 2 <= task.num_calls <= 6
        assert {r.tool for r in task.required} <= set(SCHEMAS)


# -- malformed calls -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "reason"),
    [
        ("get_weather", '{"city": "Paris"}', None),
        ("convert_units", '{"value": 3, "from_unit": "km", "to_unit": "mi"}', None),
        ("get_wether", '{"city": "Paris"}', "not offered"),
        ("get_weather", '{"city": "Paris"', "not JSON"),
        ("get_weather", '["Paris"]', "not a JSON object"),
        ("get_weather", "{}", "schema"),  # a required argument missing
        ("get_weather", '{"city": 7}', "schema"),
        ("get_weather", '{"city": "Paris", "unit": "C"}', "schema"),  # additionalProperties
        ("convert_units", '{"value": "3", "from_unit": "km", "to_unit": "mi"}', "schema"),
    ],
)
def test_malformed(name: str, arguments: str, reason: str | None) -> None:
    found = malformed(name, arguments, SCHEMAS)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


# -- the per-step arithmetic -----------------------------------------------------------------------


def step(
    prompt: int, cached: int, completion: int, new: int | None = None, computed: int | None = None
) -> Step:
    """A step whose conversation /v1/tokenize counted at its prompt, `new` after its last
    reply."""
    counters = None if computed is None else Counters(computed)
    return Step(prompt, cached, completion, (), counters, tokenized=TokenCounts(prompt, new))


MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": None, "tool_calls": []},
    {"role": "tool", "tool_call_id": "a", "content": "r1"},
    {"role": "tool", "tool_call_id": "b", "content": "r2"},
]


def test_new_tokens_are_those_after_the_last_reply_by_the_servers_counts() -> None:
    rng = random.Random()
    per_message = [rng.randint(1, 300) for _ in MESSAGES]
    prompt = rng.randint(0, 5)  # the generation prompt (an empty one too)
    count = sum(per_message) + prompt
    counts = token_counts(Conversation(MESSAGES, None), {"count": count, "messages": per_message})
    assert counts == TokenCounts(count, per_message[3] + per_message[4] + prompt)
    # No reply yet (a run's first step): nothing to count from.
    first = Conversation(MESSAGES[:2], None)
    assert token_counts(first, {"count": 9, "messages": [4, 3]}) == TokenCounts(9, None)
    # The reply last: only the generation prompt is new.
    ends = Conversation(MESSAGES[:3], None)
    assert token_counts(ends, {"count": 20, "messages": [4, 3, 9]}) == TokenCounts(20, 4)
    # Two replies: the tokens after the last one.
    again = Conversation([*MESSAGES, MESSAGES[2], MESSAGES[3]], None)
    answer = {"count": 31, "messages": [1, 2, 3, 4, 5, 6, 7]}
    assert token_counts(again, answer) == TokenCounts(31, 7 + 3)
    with pytest.raises(ValueError, match="1 counts for 2 messages"):  # not an answer for these
        token_counts(first, {"count": 9, "messages": [9]})


def test_after_a_cut_reply_new_is_reckoned_from_the_reply_as_held() -> None:
    # The committed run's weather_then_convert: the reply (64 completion tokens) was cut at a
    # repeated call and held as 47 (43 generated, the closing `}}]}`, its end of turn).
    previous = step(196, 160, 64)
    current = step(313, 239, 14, new=70, computed=75)
    assert new_tokens(current) == 70
    assert held_reply(previous, current) == 47
    assert new_by_completion(previous, current) == 53  # the completion counts 17 dropped tokens
    assert ratio(current.prefill_work, 53) == pytest.approx(75 / 53)  # 1.42: the old figure
    assert meets_goal(current)  # 75 <= 1.1 x 70
    # An uncut reply is held as its completion and its end of turn (`<|im_end|>`, a newline).
    rng = random.Random()
    prompt, completion, new = rng.randint(1, 4000), rng.randint(1, 200), rng.randint(1, 99)
    previous = step(prompt, 0, completion)
    current = step(prompt + completion + 2 + new, prompt + completion, 5, new=new)
    assert held_reply(previous, current) == completion + 2
    assert new_by_completion(previous, current) == new + 2
    assert current.prefilled == new + 2  # the end of turn is held, not in the KV


def test_new_tokens_need_the_servers_count_after_a_reply() -> None:
    with pytest.raises(ValueError, match="not counted after a reply"):
        new_tokens(step(10, 0, 1))  # counted, no reply in it
    with pytest.raises(ValueError, match="not counted after a reply"):
        new_tokens(Step(10, 0, 1, ()))  # not counted


@pytest.mark.parametrize(
    ("prefilled", "met"), [(0, True), (1, True), (109, True), (110, True), (111, False)]
)
def test_the_goal_holds_up_to_exactly_goal_times_new(prefilled: int, met: bool) -> None:
    current = step(640, 640 - prefilled, 10, new=100)  # GOAL x new = 110
    assert GOAL == 1.1
    assert new_tokens(current) == 100
    assert meets_goal(current) is met
    assert ratio(current.prefill_work, 100) == prefilled / 100


def test_the_goal_is_judged_on_the_larger_of_usage_and_the_engines_count() -> None:
    rerun = step(265, 264, 14, new=40, computed=41)  # usage: 1 prefilled; the engine: 41
    assert rerun.prefilled == 1 and rerun.prefill_work == 41
    assert ratio(rerun.prefill_work, new_tokens(rerun)) == pytest.approx(41 / 40)
    assert meets_goal(rerun)
    assert not meets_goal(step(265, 264, 14, new=40, computed=45))
    assert step(265, 200, 14, new=40, computed=3).prefill_work == 65  # the usage's, when larger


def test_ratio_with_nothing_new() -> None:
    assert ratio(0, 0) == 0.0
    assert ratio(3, 0) == math.inf
    assert ratio(3, -2) == math.inf
    assert ratio(12, 10) == pytest.approx(1.2)


# -- reading a stream ------------------------------------------------------------------------------


def chat_events() -> list[dict[str, Any]]:
    def delta(**fields: Any) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    def call_delta(index: int, **function: Any) -> dict[str, Any]:
        return delta(tool_calls=[{"index": index, "function": function}])

    return [
        delta(role="assistant", content=""),
        call_delta(0, name="get_weather", arguments=""),
        call_delta(1, name="get_time", arguments=""),
        call_delta(0, name=None, arguments='{"city":'),
        call_delta(1, arguments='{"city":"Tokyo"}'),
        call_delta(0, arguments='"Paris"}'),
        {"choices": [], "usage": {"prompt_tokens": 250, "completion_tokens": 44,
                                  "prompt_tokens_details": {"cached_tokens": 224}}},
    ]  # fmt: skip


def test_a_chat_completions_stream_gives_its_usage_and_calls_in_index_order() -> None:
    read = chat_step(chat_events())
    assert read == Step(
        250,
        224,
        44,
        (ModelCall("get_weather", '{"city":"Paris"}'), ModelCall("get_time", '{"city":"Tokyo"}')),
    )
    assert read.prefilled == 26
    assert chat_step(chat_events()[:-1]) is None  # no usage: the request failed
    assert not is_generated(chat_events()[0])  # the role alone is no generated token
    assert is_generated(chat_events()[1])


def test_a_responses_stream_gives_its_terminal_events_usage_and_calls() -> None:
    response = {
        "usage": {"input_tokens": 365, "output_tokens": 14,
                  "input_tokens_details": {"cached_tokens": 364}},
        "output": [
            {"type": "function_call", "name": "get_time", "arguments": '{"city":"Oslo"}'},
            {"type": "message", "content": []},
        ],
    }  # fmt: skip
    events = [
        {"type": "response.created", "response": {}},
        {"type": "response.output_item.added"},
        {"type": "response.completed", "response": response},
    ]
    assert responses_step(events) == Step(365, 364, 14, (ModelCall("get_time", '{"city":"Oslo"}'),))
    assert responses_step(events[:2]) is None
    assert [is_generated(e) for e in events] == [False, True, False]


def test_cut_replies_splits_answered_from_ended_replies() -> None:
    metrics = (
        "# HELP kvchat:cut_tool_replies_total Tool-call replies kvchat ended.\n"
        "# TYPE kvchat:cut_tool_replies_total counter\n"
        'kvchat:cut_tool_replies_total{outcome="repeat"} 2.0\n'
        'kvchat:cut_tool_replies_total{outcome="loop"} 1.0\n'
        'kvchat:cut_tool_replies_total{outcome="answered_repeat"} 5.0\n'
        'kvchat:cut_tool_replies_total{outcome="answered_loop"} 1.0\n'
        'kvchat:requests_total{finished_reason="stop"} 9.0\n'
    )
    assert cut_replies(metrics) == (6, 3)
    assert cut_replies("") == (0, 0)  # before any reply was cut


def test_a_failed_exchange_is_no_step() -> None:
    lines = [f"data: {json.dumps(e)}" for e in chat_events()]
    ok = Exchange("/v1/chat/completions", {}, 10, status=200, lines=lines)
    assert ok.step() is not None
    assert Exchange("/v1/chat/completions", {}, 10, status=400, lines=lines).step() is None


def test_the_recorder_keeps_the_stream_times_it_and_counts_the_servers_work() -> None:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in chat_events()) + "data: [DONE]\n\n"
    # Read before each request and once when settled: each request's growth is up to the next.
    reads = iter([Counters(100, 2, 0), Counters(126, 3, 1), Counters(160, 3, 1)])

    async def counter() -> Counters:
        return next(reads)

    def server(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/chat/completions"
        headers = {"content-type": "text/event-stream"}
        return httpx2.Response(200, content=body.encode(), headers=headers)

    async def go() -> tuple[Recorder, list[bytes]]:
        recorder = Recorder(counter, httpx2.MockTransport(server))
        async with httpx2.AsyncClient(transport=recorder) as client:
            url = "http://kvchat/v1/chat/completions"
            first = await client.post(url, json={"a": 1})
            async with client.stream("POST", url, json={"b": 22}) as second:
                async for _ in second.aiter_bytes():
                    break  # a consumer that stops early: the rest is never read
        await recorder.settle()
        return recorder, [first.content]

    recorder, contents = asyncio.run(go())
    assert contents == [body.encode()]  # passed on as it is
    first, second = recorder.exchanges
    assert first.body == {"a": 1} and first.request_bytes == len(b'{"a":1}')
    read = first.step()
    assert read is not None and read.prefilled == 26
    assert read.counters == Counters(26, 1, 1) and read.computed == 26
    assert read.ttft_ms is not None and read.latency_ms is not None
    assert 0 <= read.ttft_ms <= read.latency_ms
    assert second.counters == Counters(34, 0, 0)
    assert second.latency_ms is None  # its stream never ended


# -- the conversation a step renders ---------------------------------------------------------------

TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
CHAT_TOOLS = [{"type": "function", "function": TOOL}]
RESPONSES_TOOLS = [{"type": "function", **TOOL}]


def exchange(path: str, body: dict[str, Any], response: dict[str, Any] | None = None) -> Exchange:
    event = {"type": "response.completed", "response": response}
    lines = [] if response is None else [f"data: {json.dumps(event)}", ""]
    return Exchange(path, body, len(json.dumps(body)), status=200, lines=lines)


def test_a_chat_completions_step_renders_its_own_messages_and_tools() -> None:
    body = {"messages": MESSAGES, "tools": CHAT_TOOLS, "tool_choice": "auto"}
    earlier = exchange("/v1/chat/completions", {"messages": MESSAGES[:2]})
    rendered = conversation([earlier, exchange("/v1/chat/completions", body)])
    assert rendered == Conversation(MESSAGES, CHAT_TOOLS)
    assert rendered.tokenize_request() == {"messages": MESSAGES, "tools": CHAT_TOOLS}
    none = conversation([exchange("/v1/chat/completions", body | {"tool_choice": "none"})])
    assert none.tools is None  # tool_choice "none" renders no tools
    assert none.tokenize_request() == {"messages": MESSAGES}
    bare = conversation([exchange("/v1/chat/completions", {"messages": MESSAGES, "tools": []})])
    assert bare == Conversation(MESSAGES, None)


def call_item(call_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {"id": f"fc_{call_id}", "type": "function_call", "call_id": call_id,
            "name": "get_weather", "arguments": arguments, "status": "completed"}  # fmt: skip


def chat_call(call_id: str, city: str) -> dict[str, Any]:
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    return {"id": call_id, "type": "function", "function": function}


def responses_chain() -> list[Exchange]:
    """Three steps of an agent on the Responses API, chained by previous_response_id: each
    sends only its new items, as the Agents SDK does."""
    common = {"instructions": "Be brief.", "tools": RESPONSES_TOOLS}
    first = {"input": [{"role": "user", "content": "Oslo and Rome?"}], "tool_choice": "required"}
    two_calls = [call_item("c1", "Oslo"), call_item("c2", "Rome")]
    outputs = [
        {"type": "function_call_output", "call_id": "c1", "output": "Oslo: 3 C"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "Rome: "},
                    {"type": "input_text", "text": "19 C"}]},
    ]  # fmt: skip
    said = [{"type": "output_text", "text": "Cold in Oslo.", "annotations": []}]
    text = {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
            "content": said}  # fmt: skip
    third = [
        {"type": "function_call_output", "call_id": "c3", "output": "Oslo: 3 C"},
        {"role": "user", "content": "Thanks"},
    ]
    return [
        exchange("/v1/responses", common | first, {"id": "resp_1", "output": two_calls}),
        exchange(
            "/v1/responses",
            common | {"input": outputs, "previous_response_id": "resp_1"},
            {"id": "resp_2", "output": [text, call_item("c3", "Oslo")]},
        ),
        exchange(
            "/v1/responses",
            common | {"input": third, "previous_response_id": "resp_2", "tool_choice": "none"},
        ),
    ]


def test_a_responses_step_renders_its_chain_as_kvchat_stores_it() -> None:
    chain = responses_chain()
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Oslo and Rome?"}
    assert conversation(chain[:1]) == Conversation([system, user], CHAT_TOOLS)
    calls = {"role": "assistant", "content": None,
             "tool_calls": [chat_call("c1", "Oslo"), chat_call("c2", "Rome")]}  # fmt: skip
    results = [
        {"role": "tool", "tool_call_id": "c1", "content": "Oslo: 3 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: 19 C"},  # its parts joined
    ]
    assert conversation(chain[:2]) == Conversation([system, user, calls, *results], CHAT_TOOLS)
    # A message and a call in one output: one assistant message with both.
    answer = {
        "role": "assistant",
        "content": "Cold in Oslo.",
        "tool_calls": [chat_call("c3", "Oslo")],
    }
    third = [{"role": "tool", "tool_call_id": "c3", "content": "Oslo: 3 C"},
             {"role": "user", "content": "Thanks"}]  # fmt: skip
    rendered = conversation(chain)
    assert rendered == Conversation([system, user, calls, *results, answer, *third], None)
    counts = token_counts(rendered, {"count": 90, "messages": [9, 8, 7, 6, 5, 4, 3, 2]})
    assert counts == TokenCounts(90, 90 - (9 + 8 + 7 + 6 + 5 + 4))  # after `answer`


def test_a_responses_step_renders_the_same_as_the_chat_step_of_the_same_run() -> None:
    chain = responses_chain()[:2]
    messages = [
        {"content": "Be brief.", "role": "system"},  # the SDK's key order
        {"role": "user", "content": "Oslo and Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [chat_call("c1", "Oslo"), chat_call("c2", "Rome")]},
        {"role": "tool", "tool_call_id": "c1", "content": "Oslo: 3 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rome: 19 C"},
    ]  # fmt: skip
    chat = exchange("/v1/chat/completions", {"messages": messages, "tools": CHAT_TOOLS})
    assert conversation([chat]) == conversation(chain)


def test_a_responses_chain_that_does_not_continue_its_last_response_is_refused() -> None:
    first, second, _ = responses_chain()
    elsewhere = exchange("/v1/responses", second.body | {"previous_response_id": "resp_9"})
    with pytest.raises(ValueError, match="request 2 does not continue"):
        conversation([first, elsewhere])
    unanswered = exchange("/v1/responses", first.body)  # no terminal event: no response id
    with pytest.raises(ValueError, match="request 2 does not continue"):
        conversation([unanswered, second])
    reasoning = exchange("/v1/responses", {"input": [{"type": "reasoning", "summary": []}]})
    with pytest.raises(ValueError, match="'reasoning'"):
        conversation([reasoning])
    spoken = conversation([exchange("/v1/responses", {"input": "Hi"})])
    assert spoken == Conversation([{"role": "user", "content": "Hi"}], None)


# -- the report's helpers --------------------------------------------------------------------------


def test_calls_cell_and_repeat_guard() -> None:
    calls = (ModelCall("get_weather", '{"city": "Paris"}'), ModelCall("nope", "{}"))
    assert calls_cell(Step(1, 0, 1, calls)) == "get_weather(Paris), nope (malformed)"
    assert calls_cell(Step(1, 0, 1, ())) == "answer"
    assert repeat_guard(Counters(5, 1, 0)) == "answered"
    assert repeat_guard(Counters(5, 1, 1)) == "answered, cut"
    assert repeat_guard(Counters(5)) == repeat_guard(None) == ""


def counted(prompt: int, cached: int, completion: int, counters: Counters, new: int) -> Step:
    return Step(prompt, cached, completion, (), counters, tokenized=TokenCounts(prompt, new))


def test_findings_reckon_new_after_a_cut_reply_from_the_reply_as_held() -> None:
    from kvchat.bench.agents import TaskRun

    # The committed run's weather_then_convert: 1.42x by the completion, 75 / 70 = 1.07x now.
    cut = counted(196, 160, 64, Counters(36, 0, 1), new=196)  # the first step: no reply
    after = counted(313, 239, 14, Counters(75, 1, 0), new=70)
    run = TaskRun("chat completions", TASK["weather_then_convert"], [cut, after], [], "x", "")
    assert [(p, s, n) for p, s, _, n in later_steps([run])] == [(cut, after, 2)]
    assert findings([run]) == [
        "- the previous reply as held less its completion tokens, on the 1 later steps: -17 on 1",
        "- prefilled (usage) less new, i.e. the held history's tokens the KV did not match "
        "(prompt - new - cached): +4 on 1",
        "- the usage's prefilled is under the engine's count on 1 later steps (+1 on 1); "
        "kvchat re-ran 1 of them as an answer",
    ]


def test_findings_name_a_step_over_the_goal() -> None:
    from kvchat.bench.agents import TaskRun

    first = counted(193, 176, 25, Counters(17), new=193)
    # Held: 193 + 25 + 2 (the end of turn); cached 193 + 25; 20 new: 22 prefilled, the engine 23.
    over = counted(240, 218, 9, Counters(23, 1, 0), new=20)
    plain = counted(262, 249, 9, Counters(13), new=11)  # held 240 + 9 + 2; 13 > 1.1 x 11
    run = TaskRun("responses", TASK["weather_and_time"], [first, over, plain], [], "x", "")
    found = findings([run])
    assert found[0] == (
        "- over the goal (1.15x, 3 tokens over new): responses, weather_and_time step 2: "
        "prompt 240 = previous prompt 193 + previous reply as held 27 (its completion tokens: "
        "25) + new 20; usage: cached 218, prefilled 22; engine computed 23; the KV matched the "
        "held history but for its last 2 tokens"
    )
    assert found[1].startswith("- over the goal (1.18x, 2 tokens over new): responses, ")
    assert found[2:4] == [
        "- the previous reply as held less its completion tokens, on the 2 later steps: +2 on 2",
        "- prefilled (usage) less new, i.e. the held history's tokens the KV did not match "
        "(prompt - new - cached): +2 on 2",
    ]
    exactly = Step(240, 218, 9, (), tokenized=TokenCounts(240, 20))  # 22 = 1.1 x 20: met
    assert findings([TaskRun("responses", run.task, [first, exactly], [], "", "")]) == [
        "- the previous reply as held less its completion tokens, on the 1 later steps: +2 on 1",
        "- prefilled (usage) less new, i.e. the held history's tokens the KV did not match "
        "(prompt - new - cached): +2 on 1",
    ]


def test_findings_name_a_step_tokenize_counts_otherwise() -> None:
    from kvchat.bench.agents import TaskRun, is_tokenized_as_prompt

    first = counted(193, 176, 25, Counters(17), new=193)
    odd = Step(193, 176, 25, (), None, tokenized=TokenCounts(184, None))  # tools left out
    assert is_tokenized_as_prompt(first) and not is_tokenized_as_prompt(odd)
    assert not is_tokenized_as_prompt(Step(193, 176, 25, ()))  # not counted
    run = TaskRun("chat completions", TASK["weather_and_time"], [odd], [], "x", "")
    assert findings([run]) == [
        "- /v1/tokenize counted 184 tokens for chat completions, weather_and_time step 1, whose "
        "prompt has 193: its new tokens (the tokenize's count after the previous reply) may "
        "render otherwise"
    ]
