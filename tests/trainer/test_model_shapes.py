"""Real architectures made locally: the presets' real shapes, the BPE tokenizer, init-model, pretraining.

Models are built at tiny widths with the real vocabulary (the same config classes and code paths); the
real shapes are checked on the meta device, where a 1B model costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.bpe_tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    build_tokenizer,
    read_corpus,
    stdlib_root,
    train_bpe,
    trained_bpe,
)
from trainer.model_shapes import PRESETS, init_model, make_config, mean_loss, shapes

# Published parameter counts (tied embeddings): the presets are those models' shapes, not look-alikes.
REAL_PARAMETERS = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400}
TINY = dict(layers=2, hidden=64)


def tensor_digest(path: Path) -> str:
    tensors = load_file(str(path / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_presets_have_the_real_shapes(arch):
    tied, untied = make_config(arch), make_config(arch, untied=True)
    model = meta_model(tied)
    assert sum(p.numel() for p in model.parameters()) == REAL_PARAMETERS[arch]
    vocab, hidden = tied.vocab_size, tied.hidden_size
    assert sum(p.numel() for p in meta_model(untied).parameters()) == REAL_PARAMETERS[arch] + vocab * hidden
    assert tied.tie_word_embeddings is True and untied.tie_word_embeddings is False
    want = {
        "qwen2.5-0.5b": ("Qwen2ForCausalLM", 24, 896, 4864, 14, 2, 64, 151936, 1e6),
        "qwen3-0.6b": ("Qwen3ForCausalLM", 28, 1024, 3072, 16, 8, 128, 151936, 1e6),
        "llama-3.2-1b": ("LlamaForCausalLM", 16, 2048, 8192, 32, 8, 64, 128256, 500000.0),
    }[arch]
    attn = model.model.layers[0].self_attn
    got = (type(model).__name__, tied.num_hidden_layers, hidden, tied.intermediate_size, tied.num_attention_heads,
           tied.num_key_value_heads, attn.head_dim, vocab, tied.rope_parameters["rope_theta"])
    assert got == want
    if arch == "qwen3-0.6b":
        assert attn.q_norm.weight.shape == (128,) and attn.k_norm.weight.shape == (128,)  # Qwen3's q/k-norm
    if arch == "qwen2.5-0.5b":
        assert attn.q_proj.bias is not None  # Qwen2's QKV biases
    if arch == "llama-3.2-1b":
        rope = tied.rope_parameters
        assert (rope["rope_type"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]) == (
            "llama3", 32.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_scaled_down_keeps_class_vocabulary_and_grouped_heads(arch):
    s = shapes(arch, **TINY)
    assert s["layers"] == 2 and s["hidden"] == 64
    assert s["heads"] * s["head_dim"] == 64 and s["heads"] % s["kv_heads"] == 0
    config = make_config(arch, **TINY)
    assert type(config).__name__ == PRESETS[arch].config_class and config.vocab_size == PRESETS[arch].vocab
    s = shapes(arch, hidden=256)
    assert s["heads"] > s["kv_heads"] and s["layers"] == PRESETS[arch].layers  # still grouped-query attention
    with pytest.raises(ValueError):
        shapes(arch, hidden=48)  # not a multiple of the 32-wide heads
    with pytest.raises(ValueError):
        shapes("gpt-2")


def test_tokenizer_covers_every_byte_with_multi_character_tokens(qwen_tokenizer):
    tok = qwen_tokenizer.tokenizer
    assert len(tok) == 151936 and qwen_tokenizer.info["reserved_tokens"] > 100_000
    text = "".join(map(chr, range(256))) + " naïve 世界 🙂 def f(x):\n\treturn x ** 2  # done\r\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: every string round-trips, nothing is unknown
    assert tok.unk_token_id is None and all(0 <= i < len(tok) for i in ids)
    sample = (stdlib_root() / "argparse.py").read_text()[:20000]
    n = len(tok(sample, add_special_tokens=False)["input_ids"])
    assert len(sample) / n > 3.0, len(sample) / n  # merges: several characters a token on the corpus's text
    info = qwen_tokenizer.info
    assert info["merges"] > 16000 and info["learned_tokens"] + len(SPECIAL_TOKENS) + info["reserved_tokens"] == 151936
    # Specials after the learned tokens; reserved ids decode to their names and no text encodes to them.
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == list(range(info["learned_tokens"],
        info["learned_tokens"] + 4))
    assert tok.decode([151935]) == f"<|reserved_{info['reserved_tokens'] - 1}|>"
    assert 151935 not in tok(tok.decode([151935]), add_special_tokens=False)["input_ids"]


def test_tokenizer_is_chatml_with_im_end_as_eos(qwen_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    qwen_tokenizer.tokenizer.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3 and ids.count(tok.convert_tokens_to_ids(IM_END)) == 2
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\n2+2?\nassistant\n"
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (IM_END, PAD, None)
    assert tok.chat_template == CHAT_TEMPLATE and len(tok) == 151936


def test_training_is_deterministic_and_cached(tmp_path, bpe_cache, qwen_tokenizer):
    small = read_corpus(budget=2 << 20)
    a = train_bpe(small, 4096)
    # Another process, tokenizers' threads on: the same bytes.
    code = ("import sys; from trainer.bpe_tokenizer import read_corpus, train_bpe; "
            "sys.stdout.write(train_bpe(read_corpus(budget=2 << 20), 4096))")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    b = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
        cwd=Path(__file__).parents[2]).stdout
    assert a == b and a != train_bpe(small, 3000)
    text, hit = trained_bpe(small, 4096, tmp_path / "c")
    assert (text, hit) == (a, False)
    assert trained_bpe(small, 4096, tmp_path / "c") == (a, True)
    again = build_tokenizer(151936, cache_dir=bpe_cache)  # the session's: a cache hit, the same tokenizer
    assert again.info["cache_hit"] is True
    assert again.tokenizer.backend_tokenizer.to_str() == qwen_tokenizer.tokenizer.backend_tokenizer.to_str()


def test_init_model_is_deterministic_and_records_what_it_made(tmp_path, qwen_tokenizer):
    from transformers import AutoModelForCausalLM

    a = init_model(tmp_path / "a", "qwen2.5-0.5b", seed=3, tokenizer=qwen_tokenizer, **TINY)
    b = init_model(tmp_path / "b", "qwen2.5-0.5b", seed=3, tokenizer=qwen_tokenizer, **TINY)
    c = init_model(tmp_path / "c", "qwen2.5-0.5b", seed=4, tokenizer=qwen_tokenizer, **TINY)
    assert tensor_digest(a) == tensor_digest(b) != tensor_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    info = json.loads((a / "swarmrl_model.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(a)
    assert info["arch"] == "qwen2.5-0.5b" and info["real_shape"] is False and info["pretrain_steps"] == 0
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["shapes"]["vocab"] == model.get_input_embeddings().weight.shape[0] == 151936
    assert info["tokenizer"]["tokenizer_json_sha256"] == hashlib.sha256((a / "tokenizer.json").read_bytes()).hexdigest()
    assert info["tokenizer"]["corpus"]["files"] > 100
    ids = info["tokenizer"]["special_tokens"]
    gen = json.loads((a / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids[IM_END], ids["<|endoftext|>"]] and gen["pad_token_id"] == ids[PAD]
    assert model.config.eos_token_id == ids[IM_END]


def test_untied_head(tmp_path, llama_tokenizer):
    from transformers import AutoModelForCausalLM

    path = init_model(tmp_path / "u", "llama-3.2-1b", untied=True, tokenizer=llama_tokenizer, **TINY)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.shape == (128256, 64)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False


def test_pretraining_peaks_the_distribution(tmp_path, qwen_tokenizer):
    """A uniform model's loss is ln(151936) = 11.93; a few steps on the corpus bring the loss
    on fresh corpus windows well below."""
    from transformers import AutoModelForCausalLM

    tok = qwen_tokenizer.tokenizer
    text = "\n".join(read_corpus().texts)
    kwargs = dict(seed=1, tokenizer=qwen_tokenizer, batch_size=4, seq_len=64, lr=1e-2, **TINY)
    before = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "r", "qwen3-0.6b", **kwargs))
    path = init_model(tmp_path / "p", "qwen3-0.6b", pretrain_steps=8, **kwargs)
    after = AutoModelForCausalLM.from_pretrained(path)
    info = json.loads((path / "swarmrl_model.json").read_text())
    assert info["pretrain_steps"] == 8 and len(
        info["pretrain_losses"]) == 8 and info["pretrain_final_loss"] == info["pretrain_losses"][-1]
    start, end = mean_loss(before, tok, text, 1), mean_loss(after, tok, text, 1)
    assert abs(start - 11.93) < 0.2 and end < start - 1.5, (start, end)
    assert info["pretrain_eval_loss"] == pytest.approx(end, abs=1e-3)
    assert tensor_digest(path) == tensor_digest(init_model(tmp_path / "p2", "qwen3-0.6b", pretrain_steps=8, **kwargs))


def test_pretraining_stops_at_its_time_limit(tmp_path, qwen_tokenizer):
    """`max_seconds` (bench/gpu_check.py gives pretraining a time budget): no step starts after it."""
    from transformers import AutoModelForCausalLM

    from trainer.model_shapes import pretrain

    model = AutoModelForCausalLM.from_pretrained(init_model(tmp_path / "r", "qwen3-0.6b", seed=1,
        tokenizer=qwen_tokenizer, **TINY))
    text = "\n".join(read_corpus().texts)
    assert pretrain(model, qwen_tokenizer.tokenizer, text, 50, 0, batch_size=2, seq_len=16,
        max_seconds=0)["losses"] == []
    done = pretrain(model, qwen_tokenizer.tokenizer, text, 3, 0, batch_size=2, seq_len=16, max_seconds=600)
    assert len(done["losses"]) == 3  # `steps` still bounds it


def test_init_model_cli(tmp_path, bpe_cache):
    from typer.testing import CliRunner

    from swarmrl.cli import app

    def run(*args):
        return CliRunner().invoke(app, ["init-model", *args])

    out = tmp_path / "q3"
    res = run("--arch", "qwen3-0.6b", "--out", str(out), "--layers", "2", "--hidden", "64", "--untied",
              "--pretrain-steps", "0", "--tokenizer-cache", str(bpe_cache))
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
        config["tie_word_embeddings"]) == (
        "qwen3", 2, 64, 151936, False)
    assert len(list(bpe_cache.glob("bpe-*.json"))) == 1  # the session's tokenizer, not trained again
    assert run("--arch", "gpt-2", "--out", str(tmp_path / "x")).exit_code != 0
    assert run("--arch", "qwen3-0.6b", "--size", "tiny", "--out", str(tmp_path / "x")).exit_code != 0
    assert run("--arch", "qwen3-0.6b", "--hidden", "48", "--out", str(tmp_path / "x"), "--tokenizer-cache",
        str(bpe_cache)).exit_code != 0
    assert run("--size", "tiny", "--layers", "2", "--out", str(tmp_path / "x")).exit_code != 0
    res = run("--out", str(tmp_path / "toy"))  # no --arch: the toy model as before
    assert res.exit_code == 0 and json.loads((
        tmp_path / "toy" / "config.json").read_text())["vocab_size"] == 64, res.output
