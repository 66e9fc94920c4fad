"""Workflows with the real tokenizer, rewards and sandbox; a scripted engine stands in for the model so
the episode's shape (masks, versions, rewards) is known in advance."""

import pytest

from astraflow.engines.base import Engine, GenerateResponse, SamplingParams
from astraflow.workflows.api import WorkflowContext, resolve_reward, resolve_workflow
from astraflow.workflows.rewards import RewardRunner
from astraflow.workflows.solve_verify import verdict_reward

pytest.importorskip("transformers")


class Scripted(Engine):
    """Replies with the given texts in turn, as tokens of version 3."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts, self.version = tokenizer, list(replies), [], 3

    async def generate(self, request):
        self.prompts.append(request.prompt_ids)
        reply = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
        ids = [*reply, self.tokenizer.eos_token_id]
        return GenerateResponse(ids, [-0.5] * len(ids), [self.version] * len(ids), "stop")

    async def start(self): ...
    async def close(self): ...
    async def pause(self): ...
    async def load_weights(self, path, version): ...
    async def resume(self): ...
    async def healthy(self):
        return True


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def rewards():
    runner = RewardRunner(processes=1, timeout_s=20)
    yield runner
    runner.close()


def ctx(tokenizer, rewards, models=("policy",), **options):
    return WorkflowContext(
        {m: tokenizer for m in models}, SamplingParams(max_new_tokens=16), rewards, options
    )


async def test_rlvr_masks_the_prompt_and_scores_the_completion(tokenizer, rewards):
    flow = resolve_workflow("rlvr")(ctx(tokenizer, rewards))
    engine = Scripted(tokenizer, ["46"])
    [traj] = (await flow.run_episode({"policy": engine}, {"prompt": "12+34=", "answer": "46"})).trajectories
    p = len(engine.prompts[0])
    assert traj.loss_mask.tolist() == [0] * p + [1] * (len(traj.token_ids) - p)
    assert set(traj.versions[:p]) == {-1} and set(traj.versions[p:]) == {3}
    assert traj.reward == 1.0 and traj.error is None


async def test_numeric_reward_column_is_scored_by_the_default_reward(tokenizer, rewards):
    flow = resolve_workflow("rlvr")(ctx(tokenizer, rewards))
    sample = {"prompt": "12+34=", "answer": "46", "reward": 0.5}
    [traj] = (await flow.run_episode({"policy": Scripted(tokenizer, ["46"])}, sample)).trajectories
    assert traj.reward == 1.0 and traj.error is None


async def test_multi_turn_runs_the_tool_and_masks_its_output(tokenizer, rewards):
    flow = resolve_workflow("multi_turn")(ctx(tokenizer, rewards))
    engine = Scripted(tokenizer, ["<python>print(6*7)</python> ignored", "42"])
    [traj] = (await flow.run_episode({"policy": engine}, {"prompt": "6*7=", "answer": "42"})).trajectories
    second_prompt = engine.prompts[1]
    text = tokenizer.decode(second_prompt)
    assert text.endswith("<output>\n42\n</output>\n") and "ignored" not in text
    masked_out = [t for t, m, v in zip(traj.token_ids, traj.loss_mask, traj.versions, strict=True) if m == 0]
    assert tokenizer.decode(masked_out).endswith("<output>\n42\n</output>\n")
    assert all(v == -1 for m, v in zip(traj.loss_mask, traj.versions, strict=True) if m == 0)
    assert all(v == 3 for m, v in zip(traj.loss_mask, traj.versions, strict=True) if m == 1)
    assert traj.reward == 1.0


async def test_multi_turn_tool_that_never_ends_is_cut_by_its_limit(tokenizer, rewards):
    # The wall limit is far above the CPU one: the CPU limit must fire first, even on a loaded machine.
    flow = resolve_workflow("multi_turn")(ctx(tokenizer, rewards, tool_cpu_s=1, tool_wall_s=30))
    engine = Scripted(tokenizer, ["<python>while True: pass</python>", "done"])
    await flow.run_episode({"policy": engine}, {"prompt": "loop", "answer": "done"})
    assert "over the 1s CPU-time limit" in tokenizer.decode(engine.prompts[1])


@pytest.mark.parametrize(
    ("answer", "verdict", "solver", "verifier"),
    [("46", "yes", 1.0, 1.0), ("47", "yes", 0.0, 0.0), ("47", "no", 0.0, 1.0)],
)
async def test_solve_and_verify_rewards_each_policy(tokenizer, rewards, answer, verdict, solver, verifier):
    flow = resolve_workflow("solve_and_verify")(ctx(tokenizer, rewards, models=("solver", "verifier")))
    engines = {"solver": Scripted(tokenizer, [answer]), "verifier": Scripted(tokenizer, [verdict])}
    s, v = (await flow.run_episode(engines, {"prompt": "12+34=", "answer": "46"})).trajectories
    assert (s.model, v.model) == ("solver", "verifier")
    assert (s.reward, v.reward) == (solver, verifier)
    assert tokenizer.decode(engines["verifier"].prompts[0]) == f"12+34={answer}?"


async def test_solve_and_verify_takes_its_policies_by_name(tokenizer, rewards):
    """`verifier_model` names the verifier, whatever the order of the group's models (a judge first)."""
    models = ("judge", "solver")
    options = {"solver_model": "solver", "verifier_model": "judge"}
    flow = resolve_workflow("solve_and_verify")(ctx(tokenizer, rewards, models=models, **options))
    engines = {"judge": Scripted(tokenizer, ["no"]), "solver": Scripted(tokenizer, ["47"])}
    s, v = (await flow.run_episode(engines, {"prompt": "12+34=", "answer": "46"})).trajectories
    assert (s.model, v.model) == ("solver", "judge")
    assert (s.reward, v.reward) == (0.0, 1.0)


def test_verdicts():
    assert verdict_reward(" Yes", True) == 1.0 and verdict_reward("n", True) == 0.0
    assert verdict_reward("maybe", False) == 0.0
    assert verdict_reward("1", True, yes="1", no="0") == 1.0 and verdict_reward("0", True, "1", "0") == 0.0
    assert verdict_reward("0", False, yes="1", no="0") == 1.0 and verdict_reward("y", False, "1", "0") == 0.0


async def test_reward_runner_contains_failures(rewards):
    assert await rewards.score("exact_match", "1+1=", " 2 ", {"answer": "2"}) == (1.0, None)
    score, error = await rewards.score("no_such_reward", "p", "c", {})
    assert score == 0.0 and "reward 'no_such_reward' is not registered or named in the recipe" in error


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match=r"workflow 'nope' is not registered or named in the recipe.*rlvr"):
        resolve_workflow("nope")
    with pytest.raises(ValueError, match=r"cannot load reward 'os:nothing'"):
        resolve_reward("os:nothing", allowed={"os:nothing"})


def test_math_verify_reward():
    pytest.importorskip("math_verify")
    fn = resolve_reward("math_verify")
    assert fn("q", "so the answer is $\\frac{1}{2}$", answer="0.5") == 1.0
    assert fn("q", "the answer is 3", answer="4") == 0.0


def test_gsm8k_reward_compares_the_final_number_with_the_one_after_the_references_hashes():
    from astraflow.workflows.rewards import gsm8k

    reference = "Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips in all.\n#### 72"
    assert gsm8k("", "She sold 72 clips in total.", reference) == 1.0
    assert gsm8k("", "The answer is \\boxed{72}.", reference) == 1.0
    assert gsm8k("", "48 + 24 = 71", reference) == 0.0
    assert gsm8k("", "24 clips in May", reference) == 0.0  # a number of the reasoning, not the answer


async def test_calculator_call_is_answered_masked_and_counted(tokenizer, rewards):
    flow = resolve_workflow("multi_turn")(ctx(tokenizer, rewards, tool="calculator", max_turns=2))
    engine = Scripted(tokenizer, ["<123*45> ignored", "5535"])
    sample = {"prompt": "123*45=", "answer": "5535"}
    [traj] = (await flow.run_episode({"policy": engine}, sample)).trajectories
    assert tokenizer.decode(engine.prompts[1]) == "123*45=<123*45>5535|"
    masked_out = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m == 0]
    assert tokenizer.decode(masked_out) == "123*45=5535|"  # the prompt and the tool's reply
    assert traj.reward == 1.0 and traj.metrics == {"tool_call": 1.0}


@pytest.mark.parametrize(
    ("replies", "reward", "tool_call"),
    [(["5535"], 1.0, 0.0), (["<123**45>", "5535"], 1.0, 0.0), (["<12*45>", "540"], 0.0, 1.0)],
)
async def test_calculator_metric_counts_calls_that_ran(tokenizer, rewards, replies, reward, tool_call):
    """A direct answer is no call; a malformed one gets `error` back and does not count."""
    flow = resolve_workflow("multi_turn")(ctx(tokenizer, rewards, tool="calculator", max_turns=2))
    engine = Scripted(tokenizer, replies)
    sample = {"prompt": "123*45=", "answer": "5535"}
    [traj] = (await flow.run_episode({"policy": engine}, sample)).trajectories
    assert (traj.reward, traj.metrics["tool_call"]) == (reward, tool_call)
    if len(replies) > 1 and tool_call == 0.0:
        assert tokenizer.decode(engine.prompts[1]).endswith("error|")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12*34", "408"),
        (" 2 - 7 * (1+1)", "-12"),
        ("__import__('os')", None),
        ("9**9**9", None),
        ("10**6", None),
        ("99999999*99999999", None),
        ("1" * 41, None),
        ("1.5*2", None),
    ],
)
def test_calculator_evaluates_only_small_integer_arithmetic(expression, value):
    from astraflow.workflows.calculator import evaluate

    result = evaluate(expression)
    assert (result.ok, result.output) == ((True, value) if value else (False, "error"))


async def test_unknown_tool_is_a_clear_error(tokenizer, rewards):
    flow = resolve_workflow("multi_turn")(ctx(tokenizer, rewards, tool="abacus"))
    with pytest.raises(ValueError, match="unknown tool: 'abacus'"):
        await flow.run_episode({"policy": Scripted(tokenizer, ["1"])}, {"prompt": "1=", "answer": "1"})
