"""Tiny models: built locally and deterministically, loadable as an ordinary HF directory, trainable."""

import hashlib

import pytest

torch = pytest.importorskip("torch")


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow import tiny

    kw = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    a, b = tiny.build(tmp_path / "a", **kw), tiny.build(tmp_path / "b", **kw)
    for name in ("model.safetensors", "tokenizer.json"):
        assert digest(a / name) == digest(b / name)
    tok = AutoTokenizer.from_pretrained(a)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert len(tok) <= model.config.vocab_size
    assert tok.eos_token == tiny.EOS and tok.pad_token == tiny.PAD
    assert tok.decode(tok.encode("12+34=46")) == "12+34=46"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_warm_start_lowers_the_loss(tmp_path):
    from astraflow import tiny

    path = tiny.build(tmp_path / "m", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    first = tiny.warm_start(path, "addition", steps=1, batch=32)
    later = tiny.warm_start(path, "addition", steps=40, batch=32)
    assert later < first * 0.8


def test_calculator_warm_start_calls_the_tool_in_a_quarter_of_its_demonstrations():
    """The mix RL starts from: a call, the tool's reply (not trained on) and the answer, 25% of the time."""
    import random

    from astraflow import tiny
    from astraflow.workflows.calculator import CALL, evaluate
    from astraflow.workflows.tasks import get_task

    task, rng = get_task("calculator"), random.Random(0)
    rows = [task.sample(rng) for _ in range(2000)]
    demos = [task.demo(row, rng) for row in rows]
    assert 0.22 < sum(len(d) == 3 for d in demos) / len(demos) < 0.28
    for row, demo in zip(rows, demos, strict=True):
        if len(demo) == 3:
            (call, c), (reply, r), (answer, a) = demo
            assert (c, r, a) == (True, False, True) and answer == row["answer"]
            assert reply == evaluate(CALL.fullmatch(call).group(1)).output + "|"
        else:
            assert demo == [(row["answer"], True)]
    tok = tiny.build_char_tokenizer(tiny.CALC_VOCAB)
    text = "123*45=<123*45>5535|5535"
    assert tok.decode(tok.encode(text)) == text and tok.pad_token_id not in tok.encode(text)


def test_the_agent_warm_start_shows_what_the_chat_template_renders(tmp_path):
    """The calculator agent's demonstrations are the conversation the endpoint templates, token for token,
    with the tokenizer loaded as the engines load it (a Qwen2 model's directory)."""
    import json
    import random

    from transformers import AutoTokenizer

    from astraflow import tiny
    from astraflow.agents.toolcalls import for_template
    from astraflow.workflows.calculator import TOOL
    from astraflow.workflows.tasks import get_task

    path = tiny.build(tmp_path / "m", tokenizer_kind="char_agent", hidden=32, layers=1, heads=1, kv_heads=1)
    tok = AutoTokenizer.from_pretrained(path)
    task, rng = get_task("calculator_agent"), random.Random(1)
    row = task.sample(rng)
    while len(demo := task.demo(row, rng)) != 3:
        row = task.sample(rng)
    (call, _), (reply, _), (answer, _) = demo
    expression = row["prompt"].rstrip("=")
    arguments = json.dumps({"expression": expression})
    messages = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": arguments}}]},
        {"role": "tool", "content": answer},
    ]
    chat = tok.apply_chat_template(
        for_template(messages), tools=[TOOL], add_generation_prompt=True, tokenize=False
    )
    assert chat == tiny._framed(tok, task, row["prompt"]) + call + reply
    ids = tok.encode(chat, add_special_tokens=False)
    assert tok.decode(ids) == chat and tok.pad_token_id not in ids and len(ids) < 64


class _Torch:
    """torch's thread count alone, with the history of settings."""

    def __init__(self, threads: int):
        self.n, self.set = threads, []

    def get_num_threads(self) -> int:
        return self.n

    def set_num_threads(self, n: int) -> None:
        self.n = n
        self.set.append(n)


@pytest.mark.parametrize(
    "took, threads",
    [
        # (seconds, tokens) per step; alone: the machine's threads, kept
        ([(9, 100), (1, 100), (1, 100), (0.5, 100), (1.2, 200), (0.5, 100)], [1, 1, 1, 2, 2, 2, 2]),
        # a busy neighbour from the start: one thread
        ([(9, 100), (1, 100), (1, 100), (3, 100), (0.5, 100), (0.5, 100)], [1, 1, 1, 2, 1, 1, 1]),
        # a neighbour later: one thread from then on
        ([(9, 100), (1, 100), (1, 100), (0.5, 100), (7, 100), (0.5, 100)], [1, 1, 1, 2, 2, 1, 1]),
    ],
)
def test_the_warm_start_keeps_more_threads_only_while_they_are_quicker_per_token_than_one(took, threads):
    from astraflow.tiny import ThreadPick

    pick = ThreadPick(_Torch(2))
    seen = [pick.threads]
    for seconds, tokens in took:
        pick.took(seconds, tokens)
        seen.append(pick.threads)
    assert seen == threads


def test_on_one_core_the_warm_start_stays_on_one_thread():
    from astraflow.tiny import ThreadPick

    t = _Torch(1)
    pick = ThreadPick(t)
    for seconds in (1.0, 1.0, 1.0, 5.0):
        pick.took(seconds, 100)
    assert t.set == [1]


@pytest.mark.parametrize("threads", [1, None])
def test_a_warm_start_leaves_torchs_threads_as_it_found_them(tmp_path, threads):
    """(A later warm start in the process picks among the machine's threads, not those of the last.)"""
    from astraflow import tiny

    path = tiny.build(tmp_path / "m", hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    before = torch.get_num_threads()
    tiny.warm_start(path, "addition", steps=4, batch=8, threads=threads)
    assert torch.get_num_threads() == before
