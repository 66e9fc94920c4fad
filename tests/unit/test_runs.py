"""Run identity: a fresh run refuses keys of a run of that name; workers join a running run; a stopped
run or keys without an identity need --resume; `astraflow clear` deletes one run's keys only; batch
uids carry the run's nonce."""

import fakeredis
import pytest

from astraflow.errors import RunExistsError
from astraflow.ops.admin import clear_run
from astraflow.streams import Bus, Keys
from astraflow.streams.identity import existing, mark_stopped, open_run, provision


@pytest.fixture
def server():
    return fakeredis.FakeServer(version=(7, 0))


@pytest.fixture
async def connect(server, streams_settings):
    buses = []

    def make(run: str = "r") -> Bus:
        client = fakeredis.FakeAsyncRedis(server=server, protocol=2)
        blocking = fakeredis.FakeAsyncRedis(server=server, protocol=2)
        buses.append(Bus(Keys(run), streams_settings, client, blocking, reconnect_max_s=2))
        return buses[-1]

    yield make
    for b in buses:
        await b.close()


async def test_a_fresh_run_on_a_used_redis_is_refused_with_how_to_resume_or_clear(connect):
    first = connect()
    old = await open_run(first, fresh=True, resume=False)
    await first.bootstrap(["policy"])
    await mark_stopped(first)
    with pytest.raises(RunExistsError, match=r"--resume.*astraflow clear --run r"):
        await open_run(connect(), fresh=True, resume=False)
    with pytest.raises(RunExistsError, match="stopped"):  # a worker does not join a stopped run
        await open_run(connect(), fresh=False, resume=False)
    resumed = await open_run(connect(), fresh=False, resume=True)
    assert resumed.nonce == old.nonce and resumed.stopped is None
    assert (await open_run(connect(), fresh=False, resume=False)).nonce == old.nonce  # running again: join


async def test_workers_join_a_running_run_and_the_first_creates_it(connect):
    created = await open_run(connect(), fresh=False, resume=False)  # the first worker of a cluster run
    await connect().bootstrap(["policy"])
    for _ in range(3):  # more RaaS join
        assert (await open_run(connect(), fresh=False, resume=False)).nonce == created.nonce
    with pytest.raises(RunExistsError, match="already exists"):  # `astraflow run` is always fresh
        await open_run(connect(), fresh=True, resume=False)


async def test_keys_without_an_identity_are_adopted_only_when_resuming(connect):
    bus = connect()
    await bus.redis.hset(bus.keys.state, "v:policy", 7)  # left by a run from before run identities
    for fresh in (True, False):
        with pytest.raises(RunExistsError, match="no run identity"):
            await open_run(connect(), fresh=fresh, resume=False)
    assert await existing(bus) is None
    adopted = await open_run(connect(), fresh=False, resume=True)
    assert await existing(bus) == adopted


async def test_resume_of_nothing_is_refused(connect):
    with pytest.raises(RunExistsError, match="nothing to resume"):
        await open_run(connect(), fresh=False, resume=True)


async def test_clear_deletes_every_key_of_the_run_and_nothing_else(connect):
    mine, other = connect("r"), connect("r2")
    for b in (mine, other):
        await b.bootstrap(["policy"])
        await b.redis.hset(b.keys.state, "v:policy", 3)
    said = []
    assert await clear_run(mine, "redis://x", yes=False, ask=lambda _: "n", say=said.append) == 1
    assert await existing(mine) is not None  # not confirmed: nothing deleted
    assert await clear_run(mine, "redis://x", yes=False, ask=lambda _: "y", say=said.append) == 0
    assert await mine.redis.keys(mine.keys.prefix + "*") == []
    assert await existing(other) is not None and await other.redis.hget(other.keys.state, "v:policy")
    assert await open_run(connect("r"), fresh=True, resume=False)  # a fresh run may start now
    assert said[-1].startswith("deleted")


async def test_an_admin_provisions_the_identity_that_workers_then_join(connect):
    """`astraflow redis acl --apply` creates the run's identity (workers under per-role users may not)."""
    bus = connect()
    created = await provision(bus.redis, bus.keys)
    assert created == await provision(bus.redis, bus.keys)  # once: the same identity again
    assert (await existing(bus)).nonce == created.nonce
