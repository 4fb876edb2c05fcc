"""New llama settings for one served model (SIGHUP), the old child serving until the new one is ready
when memory allows.

Side by side (the old child is READY and both fit in memory at once): a second supervisor starts a
child on the new settings while the old one keeps serving. Once the new child passes the readiness gate
the model's requests go to it (the host's snapshot now reads the new supervisor); the old child
finishes what it was doing (the model's lane drains, up to ``proxy.drain_timeout_s``) and is stopped. A
new child that fails before the gate is stopped, and the old one never noticed: the reload is rejected
and the model is still on the last settings that passed the gate.

Stop, then start (not both in memory, or no ready child to protect): the model's own supervisor
restarts its child on the new settings on trial and rolls back to the previous ones if the new child
fails before the gate (``ChildSupervisor.try_settings``); meanwhile the model answers 503 with
Retry-After.

Either way the result is None once a child on the new settings passed the gate, or why it did not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from supervisor.child.driver import ChildSupervisor
from supervisor.child.machine import State
from supervisor.daemon.model_hosts import ModelHost
from supervisor.daemon.prepare_models import PreparedModel


async def stop_then_start(host: ModelHost, model: PreparedModel, reason: str) -> str | None:
    if not host.running or host.unloading:
        host.settle(model)  # no child to protect: the next load starts on the new settings
        return None
    p = model.prepared
    await host.save_states()
    rejected = await host.sup.try_settings(p.spec, p.identity, p.budget.as_dict(), reason)
    if rejected is None:
        host.settle(model)
    return rejected


async def side_by_side(
    host: ModelHost, model: PreparedModel, drain: Callable[[], Awaitable[object]]
) -> str | None:
    new = _successor(host, model)
    decided: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    def watch(before: State, after: State, reason: str | None) -> None:
        # The first step out of STARTING decides: READY, or a failure (exit, stall, timeout, gate).
        if before is State.STARTING and not decided.done():
            failure = new.machine.last_failure or reason
            decided.set_result(None if after is State.READY else f"llama-server {failure}")

    new.observers.append(watch)
    task = asyncio.create_task(new.run(), name=f"supervisor:{host.name}:new-settings")
    task.add_done_callback(lambda _: None if decided.done() else decided.set_result("its supervisor ended"))
    try:
        rejected = await decided
    except BaseException:
        task.cancel()  # the daemon stops meanwhile: the run ends by killing its child
        await asyncio.gather(task, return_exceptions=True)
        raise
    new.observers.remove(watch)
    if rejected is not None:
        await new.stop("reload rejected")
        await asyncio.gather(task, return_exceptions=True)
        return rejected
    await host.save_states()  # the old child's conversations, for the new one (same identity: same folder)
    old, old_task = host.adopt(new, task, model)
    try:
        await drain()
    finally:
        # Shielded: a stop of the daemon during the drain must not leave the old child behind.
        await asyncio.shield(_end(old, old_task))
    return None


async def _end(sup: ChildSupervisor, task: asyncio.Task[None] | None) -> None:
    await sup.stop("replaced by a child on the new llama settings")
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)


def _successor(host: ModelHost, model: PreparedModel) -> ChildSupervisor:
    """A supervisor for the new settings that goes on counting where the model's current one is:
    its first child is the next generation and a restart, so /readyz and the metrics read one model."""
    old, new = host.sup, host.factory(host.name, model.prepared)
    m, was = new.machine, old.machine
    m.generation, m.restarts, m.failures = was.generation, was.restarts, dict(was.failures)
    m.last_failure, m.last_failure_cause = was.last_failure, was.last_failure_cause
    new.started_at, new.last_reload, new.draining = old.started_at, old.last_reload, old.draining
    return new
