"""Prompts through a ChatML chat template on a byte-level BPE tokenizer (tests/bpe_tokenizer.py): when the
model folder has a template, the prompt's token ids are the template's rendering, its role markers are
single special tokens and the contents multi-character tokens; a ChatML completion's reward is computed on
its text without <|im_end|>."""

from __future__ import annotations

import numpy as np
import pytest

from environments.tasks import get_task
from orchestrator.config import DataConfig
from orchestrator.data import PromptSet
from tests.bpe_tokenizer import CHATML_TOKENS, make_bpe_tokenizer, multi_char
from verifier.reference import eos_token_ids
from verifier.service import decode_completion


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """A model folder with only its tokenizer: BPE, ChatML special tokens, the template in chat_template.jinja."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("bpe-chatml")
    make_bpe_tokenizer(chatml=True).save_pretrained(out)
    assert (out / "chat_template.jinja").exists() or "chat_template" in (out / "tokenizer_config.json").read_text()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    return out


def chatml(system: str, user: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("task", ["toy", "countdown", "math", "lookup"])
def test_prompts_are_the_folders_chatml_rendering(chatml_dir, task):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    start, end = tok.convert_tokens_to_ids(CHATML_TOKENS)
    ps = PromptSet.from_config(DataConfig(task=task, num_prompts=6, system_prompt="copy the digits"), chatml_dir,
        seed=0)
    assert len(ps) > 0 and ps.vocab_size == len(tok)
    for p in ps.prompts:
        ids = p.token_ids.tolist()
        messages = [{"role": "system", "content": "copy the digits"}, {"role": "user", "content": p.item.prompt}]
        assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        assert tok.decode(ids) == chatml("copy the digits", p.item.prompt)
        assert ids.count(start) == 3 and ids.count(end) == 2 and ids[0] == start  # each marker one token
        user = ids[ids.index(start, 1) : ids.index(end, ids.index(start, 1))]
        assert multi_char(tok, user), "the prompt's text should be multi-character tokens"
    off = PromptSet.from_config(DataConfig(task=task, num_prompts=6, chat_template="off"), chatml_dir, seed=0)
    assert start not in off.prompts[0].token_ids.tolist()


def test_a_chatml_completion_is_scored_without_its_end_marker(chatml_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatml_dir)
    eos = eos_token_ids(chatml_dir) | {tok.eos_token_id}
    item = get_task("toy", digits=4).make_prompts(1, seed=2)[0]
    task = get_task("toy", digits=4)
    ids = tok.encode(item.answer, add_special_tokens=False) + [tok.eos_token_id]
    assert tok.decode([tok.eos_token_id]) == "<|im_end|>"
    assert task.reward(item, decode_completion(tok, eos, np.array(ids))) == 1.0
