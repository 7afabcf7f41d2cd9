"""The worker's turn loop on a model whose tokenizer is byte-level BPE (tests/bpe_tokenizer.py): vLLM ends a
calculator turn on the first token whose text holds "?", also inside a multi-character token such as
")*7?\\n", the environment answers it, and the verifier (a full spot check: prefill, seeded draws, proofs,
the environment's replay) accepts the episodes. A random tiny model: a "?" token comes up every ~25 tokens."""

from __future__ import annotations

import time

import numpy as np
import pytest

from environments.base import model_turns
from environments.registry import environment_for, item_to_wire
from environments.tasks import get_task
from protocol.models import RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import VerdictStatus
from tests.bpe_tokenizer import make_bpe_tokenizer

HASH0 = "a" * 64


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory):
    """A random tiny Qwen2 over the BPE tokenizer's vocabulary (padded to a multiple of 64)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from trainer.tiny_model import BOS_ID, EOS_ID, PAD_ID, make_config

    tok = make_bpe_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    out = tmp_path_factory.mktemp("tiny-bpe")
    config = make_config("tiny")
    config.vocab_size = (len(tok) + 63) // 64 * 64
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def bpe_engine(bpe_model_dir):
    """Session scope, as tests/inference_worker/conftest.py's engines: closing one breaks the others."""
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    engine = RolloutEngine(bpe_model_dir, EngineConfig(max_model_len=160, kv_cache_bytes=32 << 20))
    yield engine
    engine.close()


def test_calculator_turns_stop_inside_multi_character_tokens_and_verify(bpe_engine, bpe_model_dir):
    from verifier.config import VerifierConfig
    from verifier.service import Verifier, VerifyJob

    tok = make_bpe_tokenizer()
    items = get_task("countdown").make_prompts(4, seed=6)
    prompts = [TaskPrompt(prompt_id=f"p{i}", token_ids=np.array([tok.bos_token_id] + tok.encode(it.prompt,
        add_special_tokens=False), np.int32),
                          seeds=[100 * i + s for s in range(8)], env_item=item_to_wire(it)) for i,
                          it in enumerate(items)]
    lease = TaskLease(lease_id="BPE", prompts=prompts, samples_per_prompt=8, sampling=SamplingParams(temperature=1.0,
        max_tokens=96),
                      policy_version=0, min_policy_version=0, deadline=time.time() + 600, generation_version=0,
                      environment="calculator")
    comps = bpe_engine.generate(lease)
    env = environment_for("calculator", tok, [tok.eos_token_id])
    holds = {t for t in range(len(tok)) if "?" in tok.decode([t])}
    inside = 0
    for c in comps:
        ids, mask = c.token_ids.tolist(), c.env_mask.tolist()
        turns = model_turns(np.array(mask))
        seed = lease.prompts[c.prompt_index].seeds[c.sample_index]
        for k, (a, b) in enumerate(turns):
            assert not holds & set(ids[a : b - 1]), "a turn goes on past a token that holds '?'"
            reply = env.reply(items[c.prompt_index], ids[:b], mask[:b], seed)
            if k < len(turns) - 1:
                assert ids[b - 1] in holds and ids[b : turns[k + 1][0]] == reply
                assert tok.decode(reply).startswith("=") and tok.decode(reply).endswith(";")
                inside += tok.decode([ids[b - 1]]) != "?"
    assert inside >= 3, "some tool calls should close inside a multi-character token"

    v = Verifier(VerifierConfig(keep_versions=1), lambda version: bpe_model_dir, bpe_model_dir)
    try:
        sub = RolloutSubmission(lease_id="BPE", policy_version=0, model_hash=HASH0, completions=comps)
        verdict = v.verify(VerifyJob(submission_id="s", submission=sub, lease=lease, items=items,
            task_name="countdown", expected_model_hash=HASH0))
        assert verdict.status == VerdictStatus.accepted, verdict.rejections[:3]
        assert len(verdict.rewards) == len(comps)
    finally:
        v.close()
