"""The workflow family (actor_and_verify, plan_and_solve, route, spawn, code), rewards that read token ids,
and datasets from a loader: real tokenizer, rewards and sandbox; a scripted engine stands in for each
model, so who was asked what, and each token's version, are known in advance."""

import pydantic
import pytest

from astraflow.workflows.api import check_row_rewards, reward
from astraflow.workflows.datasets import DatasetSettings, load_rows
from tests.unit import test_workflows as base
from tests.unit.test_workflows import Scripted, ctx

tokenizer, rewards = base.tokenizer, base.rewards  # the fixtures, shared

QUESTION = {"prompt": "12+34=", "answer": "46"}


def run(flow_name, tokenizer, rewards, engines, sample=QUESTION, **options):
    from astraflow.workflows.api import resolve_workflow

    flow = resolve_workflow(flow_name)(ctx(tokenizer, rewards, models=tuple(engines), **options))
    return flow.run_episode(engines, dict(sample))


def said(tokenizer, engine, i=0):
    return tokenizer.decode(engine.prompts[i])


@pytest.mark.parametrize(
    ("answer", "verdict", "actor", "verifier"), [("46", "y", 1.0, 1.0), ("47", "y", 0, 0)]
)
async def test_actor_and_verify_one_policy_plays_both_roles(
    tokenizer, rewards, answer, verdict, actor, verifier
):
    engine = Scripted(tokenizer, [answer, verdict])
    a, v = (await run("actor_and_verify", tokenizer, rewards, {"policy": engine})).trajectories
    assert (a.model, v.model) == ("policy", "policy")
    assert (a.reward, v.reward) == (actor, verifier)
    assert said(tokenizer, engine, 1) == f"12+34={answer}?"


async def test_actor_and_verify_with_another_verifier(tokenizer, rewards):
    engines = {"actor": Scripted(tokenizer, ["47"]), "judge": Scripted(tokenizer, ["n"])}
    a, v = (await run("actor_and_verify", tokenizer, rewards, engines)).trajectories
    assert (a.model, a.reward, v.model, v.reward) == ("actor", 0.0, "judge", 1.0)


@pytest.mark.parametrize(("answer", "score"), [("46", 1.0), ("45", 0.0)])
async def test_plan_and_solve_conditions_the_solver_on_the_plan(tokenizer, rewards, answer, score):
    engines = {"planner": Scripted(tokenizer, ["add tens"]), "solver": Scripted(tokenizer, [answer])}
    p, s = (await run("plan_and_solve", tokenizer, rewards, engines)).trajectories
    assert said(tokenizer, engines["planner"]) == "12+34=\nPlan:"
    assert said(tokenizer, engines["solver"]) == "add tens\n12+34="
    assert (p.model, s.model) == ("planner", "solver")
    assert p.reward == s.reward == score  # the planner is rewarded by the solver's success


async def test_route_answers_alone_or_hands_off_at_a_cost(tokenizer, rewards):
    small, large = Scripted(tokenizer, ["46"]), Scripted(tokenizer, [])
    [t] = (await run("route", tokenizer, rewards, {"small": small, "large": large})).trajectories
    assert (t.model, t.reward) == ("small", 1.0) and large.prompts == []

    small, large = Scripted(tokenizer, ["<large>"]), Scripted(tokenizer, ["46"])
    engines = {"small": small, "large": large}
    s, big = (await run("route", tokenizer, rewards, engines, handoff_cost=0.25)).trajectories
    assert said(tokenizer, large) == "12+34="
    assert (s.model, s.reward, big.model, big.reward) == ("small", 0.75, "large", 1.0)

    small, large = Scripted(tokenizer, ["<large>"]), Scripted(tokenizer, ["45"])
    s, big = (await run("route", tokenizer, rewards, {"small": small, "large": large})).trajectories
    assert (s.reward, big.reward) == (pytest.approx(-0.2), 0.0)


class Loading(Scripted):
    """A scripted engine whose weights change: reply i is sampled by `versions[i]`."""

    def __init__(self, tokenizer, replies, versions):
        super().__init__(tokenizer, replies)
        self.schedule = list(versions)

    async def generate(self, request):
        self.version = self.schedule.pop(0)
        return await super().generate(request)


async def test_spawn_trains_sub_episodes_with_each_tokens_version(tokenizer, rewards):
    """The parent asks two questions of a helper policy, gets their answers back (masked), answers; its
    weights change between its turns. Every trajectory comes back, each token with its own version."""
    parent = Loading(tokenizer, ["<spawn>12+30=</spawn><spawn>4+0=</spawn>", "46"], versions=[3, 4])
    helper = Loading(tokenizer, ["42", "4"], versions=[7, 8])
    result = await run("spawn", tokenizer, rewards, {"parent": parent, "helper": helper}, sub_model="helper")
    top, *subs = result.trajectories
    assert [t.model for t in result.trajectories] == ["parent", "helper", "helper"]
    assert sorted(said(tokenizer, helper, i) for i in range(2)) == ["12+30=", "4+0="]
    second_turn = said(tokenizer, parent, 1)
    assert second_turn.endswith("</spawn>\n<result>42</result><result>4</result>\n")

    p = len(parent.prompts[0])
    first = len(parent.prompts[1]) - p  # the first turn and the results shown to the parent
    mask, versions = top.loss_mask.tolist(), top.versions.tolist()
    turn_one = [v for m, v in zip(mask[p : p + first], versions[p : p + first], strict=True) if m]
    assert set(turn_one) == {3} and set(versions[p + first :]) == {4}
    assert all(v == -1 for m, v in zip(mask, versions, strict=True) if not m)
    assert tokenizer.decode([t for t, m in zip(top.token_ids, mask, strict=True) if not m][p:]) == (
        "\n<result>42</result><result>4</result>\n"
    )
    assert sorted(set(t.versions[t.loss_mask == 1].tolist()).pop() for t in subs) == [7, 8]
    assert all(set(t.versions[t.loss_mask == 0].tolist()) == {-1} for t in subs)
    assert top.reward == 1.0 and [t.reward for t in subs] == [1.0, 1.0]  # credit from the parent's outcome


class LoadsBetweenTurns(Scripted):
    """A scripted parent that, before its second turn, has the helper engine load new weights."""

    def __init__(self, tokenizer, replies, helper, weights):
        super().__init__(tokenizer, replies)
        self.helper, self.weights = helper, weights

    async def generate(self, request):
        if len(self.prompts) == 1:
            await self.helper.pause()
            await self.helper.load_weights(self.weights, version=1)
            await self.helper.resume()
        return await super().generate(request)


async def test_spawn_on_a_real_engine_keeps_the_version_that_sampled_each_token(
    tokenizer, rewards, tiny_model, tiny_model_v2
):
    """Sub-episodes on the hf engine, its weights loaded between them: the first sub-episode's tokens
    carry version 0, the second's version 1, and the parent sees exactly what each one wrote."""
    from astraflow.engines.hf import HFEngine
    from astraflow.engines.settings import EngineSettings

    helper = HFEngine(EngineSettings(type="hf", model=tiny_model))
    await helper.start()
    try:
        replies = ["<spawn>12+30=</spawn>", "<spawn>4+0=</spawn>", "46"]
        parent = LoadsBetweenTurns(tokenizer, replies, helper, tiny_model_v2)
        engines = {"parent": parent, "helper": helper}
        result = await run("spawn", tokenizer, rewards, engines, sub_model="helper")
    finally:
        await helper.close()
    top, first, second = result.trajectories
    assert (first.model, second.model) == ("helper", "helper")
    for traj, version in ((first, 0), (second, 1)):
        sampled = traj.loss_mask == 1
        assert sampled.any() and set(traj.versions[sampled].tolist()) == {version}
        assert (traj.logprobs[sampled] < 0).all()
        answer = tokenizer.decode(traj.token_ids[sampled].tolist(), skip_special_tokens=True).strip()
        assert f"<result>{answer}</result>" in tokenizer.decode(top.token_ids.tolist())
    assert set(top.versions[top.loss_mask == 1].tolist()) == {3}


async def test_spawn_sub_episodes_may_keep_their_own_reward(tokenizer, rewards):
    parent = Scripted(tokenizer, ["<spawn>12+30=</spawn>", "42", "46"])
    result = await run("spawn", tokenizer, rewards, {"policy": parent}, sub_credit="own")
    assert [(t.model, t.reward) for t in result.trajectories] == [("policy", 1.0), ("policy", 0.0)]
    assert said(tokenizer, parent, 1) == "12+30="
    with pytest.raises(ValueError, match="sub_credit 'all' is neither parent nor own"):
        await run("spawn", tokenizer, rewards, {"policy": parent}, sub_credit="all")


async def test_spawn_depth_bounds_recursion(tokenizer, rewards):
    """A spawn whose sub-episodes are spawns: the sub-episode's own calls are not started (depth 1)."""
    engine = Scripted(tokenizer, ["<spawn>a</spawn>", "<spawn>b</spawn>", "46"])
    result = await run("spawn", tokenizer, rewards, {"policy": engine}, sub_workflow="spawn")
    assert len(result.trajectories) == 2 and len(engine.prompts) == 3
    assert said(tokenizer, engine, 2).endswith("<result><spawn>b</spawn></result>\n")


CODE = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        (CODE, 0.75),  # three of four tests right
        (
            "def add(a, b):\n    print('x' * 10**6)\n    return a - b",
            0.25,
        ),  # its output flood changes nothing
        ("def add(a, b) return", 0.0),  # a syntax error fails every test
        ("import sys\nsys.exit(0)", 0.0),
    ],
)
async def test_code_reward_runs_the_samples_tests_in_the_sandbox(tokenizer, rewards, reply, score):
    sample = {"prompt": "write add(a, b)", "tests": TESTS}
    [t] = (
        await run("code", tokenizer, rewards, {"policy": Scripted(tokenizer, [reply])}, sample)
    ).trajectories
    assert (t.reward, t.error) == (score, None)


@pytest.mark.slow
async def test_code_that_the_sandbox_stops_gets_zero_and_a_clear_error(tokenizer, rewards):
    hang = "def add(a, b):\n    while True:\n        pass"
    sample = {"prompt": "write add(a, b)", "tests": TESTS}
    [t] = (
        await run("code", tokenizer, rewards, {"policy": Scripted(tokenizer, [hang])}, sample)
    ).trajectories
    assert t.reward == 0.0 and "raised CodeSandboxError: sandbox: stopped: over the" in t.error
    [t] = (await run("code", tokenizer, rewards, {"policy": Scripted(tokenizer, [CODE])})).trajectories
    assert t.reward == 0.0 and "the sample has no `tests`" in t.error


seen = []


@reward("test_token_count", inline=True)
def token_count(prompt, completion, prompt_ids, completion_ids, answer="", **sample):
    seen.append((prompt_ids, completion_ids))
    return float(len(completion_ids))


def text_only(prompt, completion, answer=""):
    """A reward written before rewards got token ids: no `**kwargs`."""
    return float(completion.strip() == answer)


async def test_rewards_get_the_token_ids_and_text_only_rewards_still_work(tokenizer, rewards):
    engine = Scripted(tokenizer, ["46"])
    [t] = (await run("rlvr", tokenizer, rewards, {"policy": engine}, reward="test_token_count")).trajectories
    p = len(engine.prompts[0])
    assert seen == [(engine.prompts[0], t.token_ids[p:].tolist())] and t.reward == len(t.token_ids) - p
    # in the process pool too, and a reward that takes no ids is called without them
    rewards.allowed = frozenset({f"{__name__}:text_only", f"{__name__}:ids_only"})
    assert await rewards.score(f"{__name__}:ids_only", "", "", {}, [1, 2], [3, 4, 5]) == (2 + 30.0, None)
    assert await rewards.score(f"{__name__}:text_only", "", "46", {"answer": "46"}, [1], [2]) == (1.0, None)


def ids_only(prompt, completion, prompt_ids, completion_ids):
    return float(len(prompt_ids) + 10 * len(completion_ids))


def rows(n, reward="exact_match"):
    """A dataset loader: `n` addition rows."""
    return [{"question": f"{i}+{i}=", "answer": str(2 * i), "reward": reward} for i in range(n)]


def strings():
    return ["0+0="]


def test_dataset_from_a_loader_the_recipe_names():
    settings = DatasetSettings(
        type="loader", loader=f"{__name__}:rows", loader_args={"n": 3}, fields={"prompt": "question"}
    )
    got = load_rows(settings)
    assert [(r["prompt"], r["answer"]) for r in got] == [("0+0=", "0"), ("1+1=", "2"), ("2+2=", "4")]
    with pytest.raises(pydantic.ValidationError, match="is not module:function"):
        DatasetSettings(type="loader", loader="rows")
    with pytest.raises(ValueError, match="cannot load dataset loader 'nowhere:rows'"):
        load_rows(DatasetSettings(type="loader", loader="nowhere:rows"))
    with pytest.raises(ValueError, match="row 0 is a str, not a dict"):
        load_rows(DatasetSettings(type="loader", loader=f"{__name__}:strings"))
    with pytest.raises(ValueError, match="'string:ascii_letters' is not a function"):
        load_rows(DatasetSettings(type="loader", loader="string:ascii_letters"))


def test_a_loaders_rows_pick_no_code():
    """Rows from a loader are data like any other: one naming code the recipe does not name stops the run."""
    picked = load_rows(
        DatasetSettings(
            type="loader",
            loader=f"{__name__}:rows",
            loader_args={"n": 2, "reward": "os:system"},
            fields={"prompt": "question"},
        )
    )
    with pytest.raises(ValueError, match="reward 'os:system' is not registered or named in the recipe"):
        check_row_rewards(picked, allowed={f"{__name__}:rows"})
