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
