"""Tiny models built locally and deterministically: a byte-level BPE tokenizer and a small Qwen2 model.

The result is an ordinary Hugging Face directory (config, safetensors, tokenizer with a chat template) that
the hf and vllm engines and the trainer all load. Nothing is downloaded. `warm_start` gives it a short
supervised start on a built-in task, so RL begins from a partly competent policy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

from astraflow.workflows.tasks import get_task, rows

PAD, EOS, IM_START, EOT = "<|pad|>", "<|im_end|>", "<|im_start|>", "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = (
    "the quick brown fox jumps over the lazy dog. print(sum(range(10))) def f(x): return x * 2 "
    "question: what is 3 + 4? answer: 7. user assistant system tool call result = None True False "
)


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained on the built-in tasks and a little text; pad, eos and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # These two tasks only: a task added later must not change the merges of existing tokenizers.
    corpus = [r["prompt"] + r["answer"] for name in ("addition", "reverse") for r in rows(name, 2000, seed=1)]
    corpus += [_TEXT] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, IM_START, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, additional_special_tokens=[IM_START]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHAR_VOCAB = ["<pad>", "<eos>", *"0123456789", "+", "="]
"""The character-level vocabulary of the default addition recipe (14 tokens)."""
CALC_VOCAB = [*CHAR_VOCAB, "*", "-", "<", ">", "|"]
"""`char_calc`: the same with the calculator tool's characters (`<12*34>` calls it, `408|` is its reply)."""
AGENT_WORDS = [
    *(IM_START, EOS, "\n", "system", "user", "assistant", "tool", "<tools>", "</tools>", "calculator"),
    *("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    *('{"name": "', '", "arguments": ', '{"expression": "', '"}', "}"),
]
"""`char_agent`: `char_calc`'s characters and whole-word tokens for a chat with Hermes-style tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), as a real model's merges make them few."""
AGENT_VOCAB = [*CALC_VOCAB, *AGENT_WORDS]
AGENT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ (t.function or t).name }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The `char_agent` chat template: Qwen's layout (tools in a system turn, `<tool_call>` JSON in the
assistant's turn, tool results as `<tool_response>`), with no whitespace a tiny model must learn."""
CHAR_VOCABS = {"char": CHAR_VOCAB, "char_calc": CALC_VOCAB, "char_agent": AGENT_VOCAB}


def build_char_tokenizer(vocab: list[str] = CHAR_VOCAB):
    """One token per character of `vocab` (a word of `AGENT_WORDS` in it is one token), pad and eos;
    decoding concatenates them. With the agent's words: eos is `<|im_end|>` and the chat template
    `AGENT_TEMPLATE`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Whole words are added tokens: matched before any pre-tokenizer, also the one a Qwen2 model's
    # tokenizer class puts in place when it loads.
    marks = [w for w in vocab if w in (IM_START, EOS)]
    tok.add_special_tokens([AddedToken(w, normalized=False, special=True) for w in marks])
    tok.add_tokens([AddedToken(w, normalized=False) for w in vocab if w in AGENT_WORDS and w not in marks])
    if EOS not in vocab:
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token=EOS, additional_special_tokens=[IM_START]
    )
    fast.chat_template = AGENT_TEMPLATE
    return fast


def build(
    out_dir: str | Path,
    *,
    tokenizer_kind: str = "bpe",
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 704,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Qwen2 model and its tokenizer to `out_dir` (same seed, same bytes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_kind in CHAR_VOCABS:
        tokenizer = build_char_tokenizer(CHAR_VOCABS[tokenizer_kind])
        vocab_size = len(CHAR_VOCABS[tokenizer_kind])
    else:
        tokenizer = build_tokenizer(vocab_size)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64 if tokenizer_kind in ("char", "char_calc") else 512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


SHAPES = {
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab_size=151936),
}
"""Real architectures' shapes (tied embeddings, as the released models): random weights, for measuring
what size costs (`tests/bench/weight_path.py`, the real-shape run) without fetching anything."""


def build_shape(out_dir: str | Path, shape: str, seed: int = 0) -> Path:
    """`build` at one of `SHAPES`, its tokenizer padded with filler tokens to the real vocabulary size
    (so the engines see the real embedding and logits sizes)."""
    import json

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    dims = SHAPES[shape]
    out = build(out_dir, **dims, seed=seed)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    taken = len(vocab) + len([t for t in spec["added_tokens"] if t["content"] not in vocab])
    for i in range(dims["vocab_size"] - taken):
        vocab[f"<|filler_{i}|>"] = len(vocab)
    path.write_text(json.dumps(spec))
    return out


def warm_start(
    model_dir: str | Path,
    task: str,
    *,
    steps: int = 300,
    batch: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    threads: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Supervised steps on `task` (loss on the answer and eos only; with the task's `demo`, on its trained
    segments and eos); saves in place, returns the last loss. `threads`: torch's CPU threads for it (None:
    chosen by timing its steps, `ThreadPick`). `on_step(done, loss)` after each step (a progress line)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = torch.get_num_threads()
    pick = ThreadPick(torch) if threads is None else None
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    t = get_task(task)
    loss = torch.tensor(0.0)
    model.train()
    for done in range(1, steps + 1):
        started = time.perf_counter()
        ids, labels = [], []
        for row in (t.sample(rng) for _ in range(batch)):
            p = tokenizer.encode(_framed(tokenizer, t, row["prompt"]), add_special_tokens=False)
            ids.append(list(p))
            labels.append([-100] * len(p))
            for text, trained in t.demo(row, rng) if t.demo else [(row["answer"], True)]:
                seg = tokenizer.encode(text)
                ids[-1] += seg
                labels[-1] += seg if trained else [-100] * len(seg)
            ids[-1].append(tokenizer.eos_token_id)
            labels[-1].append(tokenizer.eos_token_id)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        mask = (torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=mask, labels=label_ids).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if pick is not None:
            pick.took(time.perf_counter() - started, input_ids.numel())
        if on_step is not None:
            on_step(done, float(loss.detach()))
    torch.set_num_threads(before)
    model.save_pretrained(model_dir, safe_serialization=True)
    return float(loss.detach())


class ThreadPick:
    """Torch's CPU threads for a run of like steps on a machine that others may share, chosen by timing
    them per token (a step's batch is as wide as its longest row): the first step on one thread (untimed:
    it allocates), the next two on one, then the machine's threads (torch's default) for as long as they
    are quicker per token than one was, and one thread from the first step they are not. Alone on two
    cores, two threads took 0.55 of one's time; beside a process busy on both, seven times one's (torch's
    threads wait on each other), hence the check at every step (`tests/bench/warm_start_threads.py`)."""

    PROBE = 3  # steps on one thread: one untimed, then timed

    def __init__(self, torch) -> None:
        self.torch, self.most = torch, torch.get_num_threads()
        self.steps, self.one_s, self.one_tokens = 0, 0.0, 0  # one thread's, steps 2 to PROBE
        torch.set_num_threads(1)

    @property
    def threads(self) -> int:
        return self.torch.get_num_threads()

    def took(self, seconds: float, tokens: int) -> None:
        """Count a step of `tokens` that took `seconds`, and set the threads of the next."""
        self.steps += 1
        if self.most == 1 or self.steps == 1:
            return
        if self.steps <= self.PROBE:
            self.one_s, self.one_tokens = self.one_s + seconds, self.one_tokens + tokens
            if self.steps == self.PROBE:
                self.torch.set_num_threads(self.most)
        elif self.threads > 1 and seconds / tokens >= self.one_s / self.one_tokens:
            self.torch.set_num_threads(1)


def _framed(tokenizer, task, prompt: str) -> str:
    """The prompt as the policy sees it: as is, or as an agent's user message with the task's tools."""
    if not task.tools:
        return prompt
    message = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(
        message, tools=list(task.tools), add_generation_prompt=True, tokenize=False
    )
