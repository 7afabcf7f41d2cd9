"""The seeded sampler inside real vLLM, replayed on transformers' logits as the verifier would."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from iw_helpers import make_lease

from protocol import prf
from protocol import sampling as S

PROMPTS = [[1, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24, 25, 26], [1, 5, 40, 41]]
MAX_TOKENS = 48
# fp32 on both sides: honest logits agree to ~1e-6, so an honest margin is far below this.
TINY_MARGIN = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from verifier.reference import load_reference_model

    return load_reference_model(tiny_model_dir, None, "float32")


def reference_logits(model, prompt, completion) -> torch.Tensor:
    """Row t: transformers' logits that produced completion token t (one prefill, teacher forcing)."""
    ids = torch.tensor([list(prompt) + [int(t) for t in completion[:-1]]])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 :].float()


def replay_all(model, lease, completions):
    out = []
    for c in completions:
        prompt = lease.prompts[c.prompt_index]
        logits = reference_logits(model, prompt.token_ids.tolist(), c.token_ids.tolist())
        n = c.token_ids.size
        r = S.replay(logits, prompt.seeds[c.sample_index], torch.arange(n),
            torch.from_numpy(c.token_ids.astype(np.int64)), lease.sampling)
        out.append((c, logits, r))
    return out


def assert_honest(replays):
    for c, _, r in replays:
        tokens = torch.from_numpy(c.token_ids.astype(np.int64))
        differ = r.winner != tokens
        assert bool(r.inside.all()), f"a token outside the support: {c.token_ids.tolist()}"
        assert float(r.margin.abs().max()) <= TINY_MARGIN, (int(differ.sum()), float(r.margin.abs().max()))


def test_every_token_is_the_seeds_winner(tied_engine, reference):
    lease = make_lease(PROMPTS, [[11, 12, 2**63 - 1, 0], [5, 6, 7, 8], [9, 10, 11, 12]], temperature=1.0,
        max_tokens=MAX_TOKENS)
    completions = tied_engine.generate(lease)
    replays = replay_all(reference, lease, completions)
    assert_honest(replays)
    exact = sum(int((r.winner == torch.from_numpy(c.token_ids.astype(np.int64))).sum()) for c, _, r in replays)
    total = sum(c.token_ids.size for c in completions)
    assert exact == total  # fp32 CPU vs transformers: not one near tie on this model
    for c, logits, _ in replays:
        # The reported logprob is still the raw one: log-softmax of the unprocessed logits.
        raw = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(c.token_ids.astype(np.int64))[:, None])[:, 0]
        np.testing.assert_allclose(c.logprobs, raw.numpy(), atol=1e-4)
    # A sampling lease is not decoded greedily, and other seeds draw other tokens.
    argmax_share = np.mean([float((logits.argmax(-1).numpy() == c.token_ids).mean()) for c, logits, _ in replays])
    assert argmax_share < 0.6
    by_prompt = {}
    for c in completions:
        by_prompt.setdefault(c.prompt_index, []).append(tuple(c.token_ids.tolist()))
    assert all(len(set(v)) == len(v) for v in by_prompt.values())


def test_same_lease_twice_gives_the_same_tokens(tied_engine):
    lease = make_lease(PROMPTS, [[1, 2], [3, 4], [5, 6]], temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS)
    first = [c.token_ids.tolist() for c in tied_engine.generate(lease)]
    second = [c.token_ids.tolist() for c in tied_engine.generate(lease)]
    assert first == second


def test_a_sample_alone_and_among_32_others_is_the_same(tied_engine, reference):
    target = dict(prompt=PROMPTS[1], seed=424242)
    alone = make_lease([target["prompt"]], [[target["seed"]]], temperature=1.0, max_tokens=MAX_TOKENS)
    rng = np.random.default_rng(0)
    others = [[1] + rng.integers(3, 54, int(rng.integers(2, 12))).tolist() for _ in range(32)]
    crowd = make_lease([target["prompt"]] + others, [[target["seed"]]] + [[int(s)] for s in rng.integers(0, 2**62,
        32)], temperature=1.0, max_tokens=MAX_TOKENS)
    (a,) = tied_engine.generate(alone)
    crowded = tied_engine.generate(crowd)
    assert a.token_ids.tolist() == crowded[0].token_ids.tolist()
    np.testing.assert_allclose(a.logprobs, crowded[0].logprobs, atol=1e-5)
    assert_honest(replay_all(reference, crowd, crowded))


def test_temperature_zero_is_argmax(tied_engine, reference, tiny_model_dir):
    from test_engine import hf_greedy, hf_model

    lease = make_lease(PROMPTS, [[1, 99], [2, 98], [3, 97]], temperature=0.0, max_tokens=32)
    completions = tied_engine.generate(lease)
    hf = hf_model(tiny_model_dir)
    for c in completions:
        assert c.token_ids.tolist() == hf_greedy(hf, PROMPTS[c.prompt_index], 32)[: c.token_ids.size]
    # Two seeds of one prompt agree: no noise at temperature 0.
    assert completions[0].token_ids.tolist() == completions[1].token_ids.tolist()
    for _, _, r in replay_all(reference, lease, completions):
        assert float(r.margin.max()) == 0.0


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (-1, 0.9), (20, 0.9), (1, 1.0), (-1, 0.01)])
def test_top_k_and_top_p_are_honoured(tied_engine, reference, top_k, top_p):
    lease = make_lease(PROMPTS, [[7, 8, 9], [10, 11, 12], [13, 14, 15]], temperature=1.2, top_k=top_k, top_p=top_p,
        max_tokens=MAX_TOKENS)
    completions = tied_engine.generate(lease)
    replays = replay_all(reference, lease, completions)
    assert_honest(replays)
    for c, logits, _ in replays:
        z = logits / 1.2
        rank = (z > z.gather(1, torch.from_numpy(c.token_ids.astype(np.int64))[:, None])).sum(1)
        if top_k > 0:
            assert int(rank.max()) < top_k
        if top_k == 1 or top_p == 0.01:  # the support is the top token alone on this model's flat logits
            assert int(rank.max()) == 0
    if top_k == 20 and top_p == 1.0:  # and the restriction bites: without it, some token would lie beyond
        free = make_lease(PROMPTS, [[7, 8, 9], [10, 11, 12], [13, 14, 15]], temperature=1.2, max_tokens=MAX_TOKENS)
        ranks = [
            int((lg / 1.2 > (lg / 1.2).gather(1, torch.from_numpy(c.token_ids.astype(np.int64))[:, None])).sum(1).max())
            for c, lg, _ in replay_all(reference, free, tied_engine.generate(free))
        ]
        assert max(ranks) >= 20


def test_processor_follows_the_persistent_batch():
    """Rows added, removed, moved and swapped in vLLM's persistent batch keep their own seed and
    position; rows without our extra args are left as they are."""
    from vllm import SamplingParams as VSP
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from inference_worker.seeded_sampler import SeededSampler, extra_args

    proc = SeededSampler(None, torch.device("cpu"), False)
    v = 40
    settings = {"a": (101, 1.0, -1, 1.0), "b": (202, 0.7, 5, 1.0), "c": (303, 1.3, -1, 0.8), "d": (404, 0.0, -1, 1.0)}
    outputs = {name: [0] * n for name, n in zip("abcd", (0, 3, 7, 2))}

    def params(name):
        return VSP(temperature=0.0, extra_args=extra_args(*settings[name])) if name != "plain" else VSP(temperature=1.0)

    def expected(name, logits_row):
        seed, t, k, p = settings[name]
        states = prf.row_state(prf.seed_state(torch.tensor([seed])), torch.tensor([len(outputs[name])]))
        return int(S.draw(logits_row[None], states, prf.token_words(torch.arange(v)), S.DrawParams.build([t], [k], [p],
            v))[0])

    def check(layout: list[str]):
        logits = torch.randn(len(layout), v, generator=gen)
        before = logits.clone()
        out = proc.apply(logits)
        for i, name in enumerate(layout):
            if name == "plain":
                assert torch.equal(out[i], before[i])
            else:
                assert int(out[i].argmax()) == expected(name, before[i])
                assert int(torch.isfinite(out[i]).sum()) == 1

    gen = torch.Generator().manual_seed(0)
    outputs["plain"] = []
    proc.update_state(BatchUpdate(3, removed=[], added=[(0, params("a"), None, outputs["a"]), (1, params("plain"),
        None, []), (2, params("b"), None, outputs["b"])], moved=[]))
    check(["a", "plain", "b"])
    outputs["a"].append(5)  # a new token: the next draw is at the next position
    outputs["b"].append(6)
    check(["a", "plain", "b"])
    proc.update_state(BatchUpdate(4, removed=[1], added=[(1, params("c"), None, outputs["c"]), (3, params("d"), None,
        outputs["d"])], moved=[(0, 2, MoveDirectionality.SWAP)]))
    check(["b", "c", "a", "d"])
    proc.update_state(BatchUpdate(3, removed=[0], added=[], moved=[(3, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    check(["d", "c", "a"])
    proc.update_state(BatchUpdate(3, removed=[], added=[(1, params("plain"), None, [])], moved=[]))
    check(["d", "plain", "a"])


def test_malformed_requests_are_refused():
    from vllm import SamplingParams as VSP

    from inference_worker.seeded_sampler import SeededSampler, extra_args

    SeededSampler.validate_params(VSP(temperature=0.0, extra_args=extra_args(1, 1.0, -1, 1.0)))
    SeededSampler.validate_params(VSP(temperature=0.7))  # not ours: left alone
    for bad in (
        VSP(temperature=1.0, extra_args=extra_args(1, 1.0, -1, 1.0)),  # vLLM would add its own noise
        VSP(temperature=0.0, extra_args={"swarmrl_seeded": [1, 1.0]}),
        VSP(temperature=0.0, extra_args=extra_args(1, -1.0, -1, 1.0)),
        VSP(temperature=0.0, extra_args=extra_args(1, 1.0, -1, 0.0)),
    ):
        with pytest.raises(ValueError):
            SeededSampler.validate_params(bad)


def test_multiprocess_engine_loads_the_sampler_by_name(tiny_model_dir, tied_engine, tmp_path_factory, reference):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    sockets = tmp_path_factory.mktemp("vllm-ipc-seeded")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = str(sockets)
    try:
        engine = RolloutEngine(tiny_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20,
            multiprocess=True, proofs=False))
    finally:
        if old is None:
            os.environ.pop("VLLM_RPC_BASE_PATH")
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = old
    try:
        assert engine.llm.llm_engine.engine_core.__class__.__name__ != "InprocClient"
        lease = make_lease(PROMPTS, [[31, 32], [33, 34], [35, 36]], temperature=0.8, top_k=30, top_p=0.95,
            max_tokens=MAX_TOKENS)
        mp = engine.generate(lease)
        ip = tied_engine.generate(lease)
        assert [c.token_ids.tolist() for c in mp] == [c.token_ids.tolist() for c in ip]
        assert_honest(replay_all(reference, lease, mp))
    finally:
        engine.close()
        shutil.rmtree(sockets, ignore_errors=True)
