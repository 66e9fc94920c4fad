"""`astraflow workflow push` from a process that has the workflow's module, to a running RaaS process (hf
engine, tiny model) that has not: the RaaS runs it without a restart, and logs what it loaded."""

import os
import subprocess
import sys

import pytest
from pydantic import SecretStr

from astraflow.config import Settings
from astraflow.streams.reap import Reaper
from astraflow.workflows.pushed import PushedWorkflows, push
from tests.integration.raas_helpers import raas_settings, rollouts, spawn_raas, stop, submit, wait_for
from tests.integration.test_acl import admin, as_role, connect, denials, install, refused, server  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.one_redis]

KEY = "integration-push-key"
MODULE = '''
from astraflow.engines.base import GenerateRequest
from astraflow.workflows.api import EpisodeResult, RolloutWorkflow
from astraflow.workflows.rlvr import encode_prompt, trajectory


def bonus(completion):
    return 0.375


class Bonus(RolloutWorkflow):
    """One turn on the real engine, rewarded by this module's own function."""

    async def run_episode(self, engines, sample):
        model = next(iter(engines))
        tokenizer = self.ctx.tokenizers[model]
        _, ids = encode_prompt(tokenizer, sample, False)
        resp = await engines[model].generate(GenerateRequest(ids, self.ctx.sampling))
        return EpisodeResult([trajectory(model, ids, resp, bonus(tokenizer.decode(resp.token_ids)), None)])
'''


def push_cli(redis_url: str, module_dir, key: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ASTRAFLOW_RAAS__PUSH_KEY": key, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "astraflow.cli", "workflow", "push", "user_flow_x7:Bonus", "--run", "it"]
    return subprocess.run(
        [*cmd, "--redis", redis_url], cwd=module_dir, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
async def test_a_workflow_pushed_to_a_running_raas_runs_there_without_its_module(
    bus, redis_url, tiny_model, tmp_path
):
    module_dir = tmp_path / "pusher"
    module_dir.mkdir()
    (module_dir / "user_flow_x7.py").write_text(MODULE)
    settings = raas_settings(
        redis_url, tiny_model, tmp_path, "raas-p", accept_pushed_code=True, push_key=SecretStr(KEY)
    )
    worker = spawn_raas(settings)
    try:
        await wait_for(lambda: bus.redis.exists(bus.keys.raas("raas-p")), what="the RaaS up")
        wrong = push_cli(redis_url, module_dir, "not-the-key")
        assert wrong.returncode == 0, wrong.stderr
        [refused] = await submit(bus, 1, workflow="user_flow_x7:Bonus")
        reaper = Reaper(bus)  # the dataflow's part (none runs here): no RaaS dead-letters a prompt

        async def dead_lettered() -> int:
            await reaper.sweep(bus.keys.prompts)
            return await bus.redis.xlen(bus.keys.dead)

        await wait_for(dead_lettered, what="the wrongly signed push refused")

        done = push_cli(redis_url, module_dir, KEY)  # a correct push replaces it; the RaaS still runs
        assert done.returncode == 0 and "pushed user_flow_x7:Bonus" in done.stdout, done.stderr
        uids = await submit(bus, 2, start=10, workflow="user_flow_x7:Bonus")
        await wait_for(lambda: bus.redis.xlen(bus.keys.rollouts), 60, "rollouts of the pushed workflow")
        await wait_for(lambda: _count(bus, 2), 60, "both groups")
    finally:
        assert stop(worker) == 0
    groups = await rollouts(bus)
    assert sorted(g.uid for g in groups) == uids
    for t in (t for g in groups for t in g.trajectories):
        assert t.reward == 0.375 and t.error is None and set(t.versions[t.loss_mask == 1]) == {0}
    [(_, dead)] = await bus.redis.xrange(bus.keys.dead)
    assert dead[b"field.uid"].decode() == refused and b"signature does not verify" in dead[b"reason"]
    log = (tmp_path / "raas-p.log").read_text()
    assert "pushed_workflow_refused" in log and "pushed_workflow_loaded" in log and "user_flow_x7" in log


async def _count(bus, n):
    return await bus.redis.xlen(bus.keys.rollouts) >= n


async def test_under_acl_users_a_raas_reads_pushed_workflows_and_cannot_push_one(admin, server, tmp_path):  # noqa: F811
    passwords = await install(admin, "it")
    base = Settings()
    base.run.name, base.redis.url = "it", server.display_url
    base.raas.accept_pushed_code, base.raas.push_key = True, SecretStr(KEY)
    (tmp_path / "user_flow_x7.py").write_text(MODULE)
    pusher = connect(server.url, base)  # an admin connection
    raas = connect(server.display_url, as_role(base, "it", "raas", passwords["raas"]))
    try:
        await raas.identity()
        sys.path.insert(0, str(tmp_path))
        try:
            await push(pusher, KEY.encode(), "user_flow_x7:Bonus")
        finally:
            sys.path.remove(str(tmp_path))
        sys.modules.pop("user_flow_x7", None)
        flow = await PushedWorkflows(raas, base.raas).resolve("user_flow_x7:Bonus", ())
        assert flow.__name__ == "Bonus" and await denials(admin) == []
        assert await refused(lambda: raas.redis.hset(raas.keys.workflows, "evil", b"x"))
    finally:
        await pusher.close()
        await raas.close()
