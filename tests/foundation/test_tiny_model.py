"""Tiny models made locally: deterministic, tied or untied, and transformers and vLLM agree on them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.tiny_model import ALPHABET, EOS_ID, init_model, make_tokenizer, pretrain_corpus


def tensor_digest(path: Path) -> str:
    tensors = load_file(str(path / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()


def test_same_seed_same_model_other_seed_other_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", "off")  # determinism of the maker, not of the cache
    a = init_model(tmp_path / "a", "tiny", seed=3)
    b = init_model(tmp_path / "b", "tiny", seed=3)
    c = init_model(tmp_path / "c", "tiny", seed=4)
    assert tensor_digest(a) == tensor_digest(b) != tensor_digest(c)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_pretrain_corpus_never_shows_the_demo_task():
    import random
    import re

    texts = pretrain_corpus(2000, random.Random(0))
    assert all(re.fullmatch(r"copy:([a-z]{1,3})=\1|say:([0-9]{1,3})=\2", t) for t in texts), texts[:5]
    assert {t.split(":")[0] for t in texts} == {"copy", "say"}
    assert not any(re.match(r"copy:[0-9]", t) for t in texts)  # the toy task's prompts


def test_pretraining_teaches_the_echo_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", "off")  # determinism of the maker, not of the cache
    from transformers import AutoModelForCausalLM

    a = init_model(tmp_path / "a", "tiny", seed=3, pretrain_steps=30)
    assert tensor_digest(a) == tensor_digest(init_model(tmp_path / "b", "tiny", seed=3, pretrain_steps=30))
    assert tensor_digest(a) != tensor_digest(init_model(tmp_path / "c", "tiny", seed=3))
    assert json.loads((a / "swarmrl_model.json").read_text())["pretrain_steps"] == 30

    tok = make_tokenizer()
    ids = torch.tensor([tok("say:7=")["input_ids"] + [tok.convert_tokens_to_ids("7"), EOS_ID]])

    def answer_loss(path: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(path)
        labels = ids.clone()
        labels[0, :6] = -100
        return model(input_ids=ids, labels=labels).loss.item()

    assert answer_loss(a) < answer_loss(tmp_path / "c") - 0.5


def test_tied_and_untied(tiny_model_dir, tiny_untied_model_dir):
    from transformers import AutoModelForCausalLM

    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    untied = AutoModelForCausalLM.from_pretrained(tiny_untied_model_dir)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert json.loads((tiny_model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((tiny_untied_model_dir / "config.json").read_text())["tie_word_embeddings"] is False


def test_tokenizer_is_one_token_per_character():
    tok = make_tokenizer()
    text = "copy:4821=4821"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID
    assert all(len(tok(ch).input_ids) == 1 for ch in ALPHABET)


def test_tokenizer_reloaded_from_a_model_folder_is_the_same(tmp_path):
    """The worker, vLLM and the verifier load a model folder's tokenizer with AutoTokenizer, which reads
    config.json's `qwen2` and builds Qwen2Tokenizer's byte-level pipeline from the vocabulary: it must give the
    maker's ids and text. A character vocabulary had no `Ġ`, so every space was dropped on reload."""
    import random

    from transformers import AutoTokenizer

    from trainer.tiny_model import make_config, padded_vocab_size, vocab

    make_config().save_pretrained(tmp_path)
    tok = make_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok) == len(vocab()) <= padded_vocab_size() == 64  # no model shape changes
    # Models made before keep working: the original characters keep their ids.
    original = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=()?:;,.<>"
    assert tok(original).input_ids == loaded(original).input_ids == list(range(3, 3 + len(original)))
    rng = random.Random(0)
    texts = [ALPHABET, 'a\nb "quoted" \'it\'s\' [1, 2]_x!\n\n', "  two  spaces  ",
        *("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30))) for _ in range(200))]
    for text in texts:
        ids = tok(text).input_ids
        assert len(ids) == len(text) and loaded(text).input_ids == ids, text
        assert loaded.decode(ids) == tok.decode(ids) == text
    # Characters without a token (capitals, tabs, accents) are dropped, the same way by both.
    assert loaded.decode(loaded("Spell this word: cat").input_ids) == "pell this word: cat"
    for text in ["Spell THIS\tcafé", "e\u0301!", "<|eos|>x"]:
        assert loaded(text).input_ids == tok(text).input_ids, text


def test_init_model_cli(tmp_path):
    from typer.testing import CliRunner

    from swarmrl.cli import app

    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "m"), "--size", "tiny", "--seed", "5",
        "--no-tie-embeddings"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is False
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "x"), "--size", "huge"])
    assert res.exit_code != 0
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "p"), "--size", "tiny", "--pretrain-steps",
        "2"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "p" / "swarmrl_model.json").read_text())["pretrain_steps"] == 2
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "q"), "--pretrain-steps", "-1"])
    assert res.exit_code != 0
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "t"), "--pretrain-steps", "2",
        "--pretrain-target", "1", "--pretrain-max-steps", "4"])
    assert res.exit_code == 0 and "pretrain steps 4" in res.output, res.output  # an unreachable bar: the cap
    assert json.loads((tmp_path / "t" / "swarmrl_model.json").read_text())["pretrain_max_steps"] == 4
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "u"), "--pretrain-target", "1.5"])
    assert res.exit_code != 0


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_untied_model_dir"])
def test_transformers_and_vllm_agree_on_greedy_tokens(fixture, request, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    # A freshly initialised model is nearly uniform and greedy-decodes one token forever, which would make
    # agreement trivial. Larger random weights give varied greedy sequences.
    hf = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.add_(torch.randn_like(param) * 0.3)
    model_dir = tmp_path / "model"
    hf.save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    tok = make_tokenizer()
    prompts = [tok(t).input_ids for t in ["copy:123=", "9+4=", "abc"]]
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                pad_token_id=0)
            want.append(out[0, len(ids):].tolist())
    llm = LLM(str(model_dir), distributed_executor_backend="uni", enforce_eager=True, kv_cache_memory_bytes=32 << 20,
        dtype="float32", max_model_len=256, seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], SamplingParams(temperature=0.0,
            max_tokens=12, ignore_eos=True), use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        # vLLM's own tokenizer of the folder (AutoTokenizer underneath) reads text as the maker's does.
        text = "Spell this: a b\nc!"
        vllm_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    finally:
        del llm
    assert vllm_ids == tok(text).input_ids and len(vllm_ids) == len(text) - 1  # only the capital is dropped
    assert len({t for seq in want for t in seq}) >= 4, want  # the comparison is not trivial
    assert got == want


def test_tool_format_corpus_is_opt_in():
    """The multi-turn demo's base model adds the lookup tool format; the default corpus is the one before it."""
    import random

    from trainer.tiny_model import pretrain_corpus

    default = pretrain_corpus(30, random.Random(3))
    assert default == pretrain_corpus(30, random.Random(3), tool_format=False)
    assert not any(t.startswith("ask:") for t in default)
    tool = pretrain_corpus(30, random.Random(3), tool_format=True)
    asks = [t for t in tool if t.startswith("ask:")]
    assert len(asks) == 10 and all(t.startswith("ask:=?") and t.split("=")[1][1:] == t.split("=")[2] for t in asks)
    assert not any(ch.isdigit() for t in asks for ch in t)  # letters only: digits are left for RL


def test_pretraining_to_a_target_stops_at_the_first_check_that_reaches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", "off")  # determinism of the maker, not of the cache
    """The quality bar: at least `pretrain_steps`, then a check every 10 steps; the model it stops at is the
    fixed-step model of that many steps (the checks draw no randomness), and the check before fell short."""
    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import echo_accuracy

    target = 0.02  # the tiny model gets there within a few dozen steps: an easy case
    a = init_model(tmp_path / "a", "tiny", seed=3, pretrain_steps=10, pretrain_target=target, pretrain_max_steps=200)
    info = json.loads((a / "swarmrl_model.json").read_text())
    steps = info["pretrain_steps"]
    assert 10 < steps < 200 and (steps - 10) % 10 == 0, info
    assert info["pretrain_echo_accuracy"] >= target and info["pretrain_min_steps"] == 10
    # Deterministic: another call, with a fixed step count, makes the same weights.
    assert tensor_digest(a) == tensor_digest(init_model(tmp_path / "fixed", "tiny", seed=3, pretrain_steps=steps))

    import random

    checked = pretrain_corpus(256, random.Random("echo-check-3"))  # the lines the rule checks
    before = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "before", "tiny", seed=3,
        pretrain_steps=steps - 10))
    assert echo_accuracy(before, checked) < target


def test_pretraining_to_a_target_respects_the_cap(tmp_path):
    threads = torch.get_num_threads()
    a = init_model(tmp_path / "a", "tiny", seed=4, pretrain_steps=5, pretrain_target=1.0, pretrain_max_steps=20)
    assert torch.get_num_threads() == threads  # pretraining runs on one thread, then gives the caller's back
    info = json.loads((a / "swarmrl_model.json").read_text())
    assert info["pretrain_steps"] == 20 and info["pretrain_echo_accuracy"] < 1.0, info
    assert tensor_digest(a) == tensor_digest(init_model(tmp_path / "fixed", "tiny", seed=4, pretrain_steps=20))


def test_echo_accuracy_is_greedy_decoding_exact_match(tmp_path):
    """Teacher-forced argmax over the answer and EOS is right exactly when greedy decoding writes them."""
    import random

    from transformers import AutoModelForCausalLM

    from trainer.tiny_model import echo_accuracy

    model = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "m", "tiny", seed=1, pretrain_steps=60)).eval()
    tok = make_tokenizer()
    lines = pretrain_corpus(48, random.Random(5))
    right = 0
    with torch.no_grad():
        for line in lines:
            prompt, answer = line.split("=")
            ids = torch.tensor([tok(prompt + "=")["input_ids"]])
            out = model.generate(ids, max_new_tokens=len(answer) + 1, do_sample=False, eos_token_id=None,
                pad_token_id=0)
            right += out[0, ids.shape[1]:].tolist() == tok(answer)["input_ids"] + [EOS_ID]
    assert 0 < right < len(lines)  # neither all wrong nor all right: the comparison says something
    assert echo_accuracy(model, lines) == right / len(lines)
