"""redis_pipe.Pipe against the real Redis: a turn's commands leave together, and each gets its own result or
error, whether the turn sent one command or several."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from serving.dataplane.transport import redis_pipe

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
KEY = f"ferry:test:pipe:{os.getpid()}"


@pytest.fixture
async def pipe():  # noqa: ANN201
    client = redis_pipe.client(REDIS_URL)
    await client.delete(KEY, KEY + ":text")
    await client.set(KEY + ":text", "not a number")
    p = redis_pipe.Pipe(client)
    p.start()
    yield p
    await p.close()
    await client.delete(KEY, KEY + ":text")
    await client.aclose()


async def test_one_command_alone_gets_its_result_or_its_own_error(pipe) -> None:  # noqa: ANN001
    # a turn with one command: sent on its own, not as a pipeline of one
    assert await pipe.send("INCR", KEY) == 1
    with pytest.raises(redis.ResponseError):
        await pipe.send("INCR", KEY + ":text")
    # and the pipe goes on
    assert await pipe.send("INCR", KEY) == 2


async def test_a_turns_commands_leave_together_and_each_gets_its_own_answer(pipe) -> None:  # noqa: ANN001
    batches = []
    execute = pipe._execute

    async def counted(batch):  # noqa: ANN001, ANN202
        batches.append(len(batch))
        return await execute(batch)

    pipe._execute = counted
    answers = await asyncio.gather(
        pipe.send("INCR", KEY), pipe.send("INCR", KEY + ":text"), pipe.send("INCR", KEY), return_exceptions=True
    )
    assert batches == [3]
    assert answers[0] == 1 and answers[2] == 2
    assert isinstance(answers[1], redis.ResponseError)
