"""A RaaS's notice follower and eval groups: a group of eval version E runs once E's own notice is
applied - not when the engines merely pass through E while another notice is applied (they move on
under the episodes) - and is given up once a later notice is applied. An engine ahead of E goes back."""

import asyncio

from astraflow.messages import VersionNotice, encode
from astraflow.raas.follow import NoticeFollower


class Engine:
    def __init__(self, version: int) -> None:
        self.version = version


def follower(**versions: int) -> NoticeFollower:
    f = NoticeFollower(None, {m: Engine(v) for m, v in versions.items()}, {}, None)  # type: ignore[arg-type]

    async def load(model, engine, version, notice) -> bool:  # a load that takes a while
        await asyncio.sleep(0.02)
        engine.version = version
        async with f._loaded:
            f._loaded.notify_all()
        return True

    f._load = load  # type: ignore[method-assign]
    return f


def notice(version: int, eval_: bool = False, **models: int) -> dict:
    return encode(VersionNotice(uid=f"n{version}", version=version, models=models, manifests={}, eval=eval_))


async def test_an_eval_group_waits_for_its_notice_not_for_engines_passing_through():
    f = follower(a=10, b=9)
    group = asyncio.create_task(f.at_eval_version(["a", "b"], 10))
    # A notice of 9 whose loads pass through 10 (b loads 10 first, while a is still at 10), then a to 11.
    assert await f._apply(notice(9, b=10, a=11))
    await asyncio.sleep(0.05)
    assert not group.done()
    assert await f._apply(notice(10, eval_=True, a=10, b=10))  # exact: a goes back to 10
    assert await asyncio.wait_for(group, 1) is True
    assert {m: e.version for m, e in f.engines.items()} == {"a": 10, "b": 10}


async def test_an_eval_group_of_a_passed_version_is_given_up_at_once():
    f = follower(a=0)
    assert await f._apply(notice(11, a=11))
    assert await asyncio.wait_for(f.at_eval_version(["a"], 10), 1) is False


async def test_a_failed_exact_load_is_not_retried_with_newer_weights():
    f = follower(a=9)

    async def failing(model, engine, version, notice) -> bool:
        raise ConnectionError("the trainer is away")

    f._load = failing  # type: ignore[method-assign]
    assert await f._apply(notice(10, eval_=True, a=10), newest=True) is False
    assert f.noticed == -1 and f.synced.is_set()  # non-eval work goes on; eval groups keep waiting
