"""A real agent loop that lmkit did not write (the OpenAI Agents SDK) drives the api_server end to end on
loopback: its model is forced to call a tool, the SDK runs the tool with the parsed arguments, sends the result
back in OpenAI's message shapes (rendered by the model's own chat template), and takes the next answer."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import Field


agents = pytest.importorskip("agents")


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1", "mistral", "qwen3_coder"])
def test_openai_agents_sdk_runs_a_tool_loop(servers, family):  # noqa: F811
    from openai import AsyncOpenAI

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)], days: Annotated[int, Field(ge=1, le=3)]) -> str:
        """The weather of a city for the next days."""
        seen.append((city, days))
        return f"sunny in {city} for {days} days"

    client = AsyncOpenAI(base_url=f"{servers[family].url}/v1", api_key="none", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=family, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=1.0,
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    # one call made with arguments that validated (the SDK parsed them into the function's types), then an answer
    assert len(seen) == 1 and len(seen[0][0]) <= 10 and 1 <= seen[0][1] <= 3, seen
    assert isinstance(result.final_output, str)
    assert len(result.raw_responses) == 2
