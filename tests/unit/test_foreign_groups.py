"""Consumer groups a run does not know: `astraflow inspect` warns, `clear --unknown-groups` removes them
(issue 20, item 6; trimming past them: tests/unit/test_bus.py)."""

from __future__ import annotations

from astraflow.ops.inspect import render
from astraflow.streams.views import inspect_run, remove_unknown_groups


async def test_inspect_warns_about_a_foreign_group_and_clear_removes_it(bus):
    await bus.redis.xadd(bus.keys.rollouts, {"uid": "u"})
    await bus.redis.xgroup_create(bus.keys.rollouts, "evil", id="0")
    text = render(await inspect_run(bus), 0)
    assert "WARNING: group 'evil' on rollouts is not one of the run's" in text
    assert "'dataflow' on" not in text
    assert await remove_unknown_groups(bus) == [(bus.keys.rollouts, "evil")]
    assert [g["name"] for g in await bus.redis.xinfo_groups(bus.keys.rollouts)] == [b"dataflow"]
    assert "WARNING" not in render(await inspect_run(bus), 0)
