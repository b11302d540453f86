"""Several generations for one response (`n` > 1): started together, streamed interleaved."""

from __future__ import annotations

import asyncio
import dataclasses

from .jobs import Job, JobSpec
from .state import USAGE, ServerState


class JobGroup:
    """The jobs of one response; closing it cancels every one still running."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def close(self) -> None:
        for job in self.jobs:
            job.close()

    @property
    def completion_tokens(self) -> int:
        return sum(job.result.completion_tokens for job in self.jobs)


def choice_specs(spec: JobSpec, n: int, make_constraint) -> list[JobSpec]:
    """n copies of a request: seeded ones get seed, seed+1, ... (else the choices would be
    equal); each gets its own grammar state."""
    out = []
    for i in range(n):
        params = spec.params
        if params.seed is not None and i:
            params = dataclasses.replace(params, seed=params.seed + i)
        out.append(dataclasses.replace(spec, params=params,
                                       constraint=make_constraint() if make_constraint else None))
    return out


async def start_jobs(state: ServerState, specs: list[JobSpec], is_disconnected) -> JobGroup:
    """Submit every choice; if one is refused, the others are cancelled and its error raised."""
    jobs = [Job(state.engine, state.tokenizer, spec, is_disconnected, state.turns.remember)
            for spec in specs]
    group = JobGroup(jobs)
    try:
        state.engine.submit(*(job.request for job in jobs))
        for job in jobs:
            await job.accepted()
    except BaseException:
        group.close()
        raise
    return group


async def interleave(streams):
    """Items of several async generators as they come; an error in one ends all of them."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put((item, None))
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((None, exc))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                left -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()


async def start_response(request, state: ServerState, spec: JobSpec, grammar_source, n: int = 1) -> JobGroup:
    """What every API codec does with its one internal request: compile its grammar (one matcher
    per choice), submit its n choices together, and count the response's usage on the first."""
    make = None
    if grammar_source is not None:
        grammar = await state.off_loop(state.compile_grammar, *grammar_source)
        make = lambda: state.grammar.constraint(grammar)  # noqa: E731 - one matcher per choice
    group = await start_jobs(state, choice_specs(spec, n, make), lambda: client_gone(request))
    request[USAGE] = group.jobs[0].usage
    return group


def client_gone(request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
