"""Multi-turn episodes: the turn loop of a lease that names an environment (environments/).

All samples of the lease advance turn by turn: one vLLM generate call per turn, each sample's prompt
being its prompt + episode so far as token ids (`TokensPrompt`: no text round trip, the ids the model saw
are the ids submitted). A turn's tokens are drawn by the seeded sampler starting at the turn's index in
the episode (`extra_args(..., offset)`), so environment tokens consume draw positions exactly as the
verifier's replay counts them. Between turns the environment (the same code the verifier replays) answers
each sample that called a tool. The whole episode runs inside one `RolloutEngine.generate` call, and the
worker loop reloads weights only between leases: one policy version per episode.

Hidden states are captured per turn and concatenated over the model's positions; the proofs are built
over that concatenation (one per 32 model tokens), which is what the verifier's prefill recomputes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from environments.registry import environment_for, item_from_wire
from inference_worker.generation import GenerationStats, LeaseNotGeneratable, finish_reason
from protocol import limits
from protocol.models import Completion, FinishReason, TaskLease
from verifier.proofs import build_proofs_many


@dataclass
class _Episode:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    seed: int
    item: object
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    finishes: list[FinishReason] = field(default_factory=list)
    done: bool = False


def generate_episodes(engine, lease: TaskLease, return_hidden: bool) -> tuple[list[Completion], list[torch.Tensor]]:
    """Every sample of `lease` as a whole episode, with `engine` (an inference_worker.engine.RolloutEngine)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from inference_worker.capture import hidden_from_bytes
    from inference_worker.seeded_sampler import extra_args

    tokenizer = engine.llm.get_tokenizer()
    eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
    if lease.environment not in engine.environments:  # making one reads every token's text (~0.5 s for 150k tokens)
        engine.environments[lease.environment] = environment_for(lease.environment, tokenizer, eos)
    env = engine.environments[lease.environment]
    cap = env.limits.max_episode_tokens
    if lease.sampling.max_tokens < cap:  # the orchestrator's config refuses this; the turn caps would disagree
        raise LeaseNotGeneratable(f"lease max_tokens {lease.sampling.max_tokens} is below environment {env.name!r}'s "
            f"episode cap {cap}")
    episodes: list[_Episode] = []
    for pi, prompt in enumerate(lease.prompts):
        ids = [int(t) for t in prompt.token_ids]
        if len(ids) + cap > engine.max_model_len:
            raise LeaseNotGeneratable(f"prompt {prompt.prompt_id}: {len(ids)} prompt tokens + episode cap {cap} "
                f"exceed max_model_len {engine.max_model_len}")
        if prompt.env_item is None:
            raise LeaseNotGeneratable(f"prompt {prompt.prompt_id}: an environment lease without the environment's item")
        item = item_from_wire(prompt.prompt_id, prompt.env_item)
        episodes += [_Episode(pi, si, ids, int(seed), item) for si, seed in enumerate(prompt.seeds)]

    s = lease.sampling
    stops = sorted(set(s.stop_token_ids) | set(env.stop_token_ids))
    started = time.perf_counter()
    while True:
        active = [e for e in episodes if not e.done]
        if not active:
            break
        caps = [env.turn_cap(len(e.tokens)) for e in active]
        prompts = [TokensPrompt(prompt_token_ids=e.prompt + e.tokens) for e in active]
        params = [SamplingParams(temperature=0.0, extra_args=extra_args(e.seed, s.temperature, s.top_k, s.top_p,
            offset=len(e.tokens)),
                                 max_tokens=c, stop_token_ids=stops, logprobs=0, detokenize=False) for e,
                                 c in zip(active, caps)]
        engine.llm.collective_rpc("swarmrl_capture_start", args=(False,))
        try:
            outputs = engine.llm.generate(prompts, params, use_tqdm=False, lora_request=engine.lora_request)
        except BaseException:  # stop the capture so that rows never pile up
            engine.llm.collective_rpc("swarmrl_capture_take", args=({}, False, False))
            raise
        lengths = {o.request_id: [len(p["prompt_token_ids"]), len(o.outputs[0].token_ids)] for o, p in zip(outputs,
            prompts)}
        taken = engine.llm.collective_rpc("swarmrl_capture_take", args=(lengths, False, True))[0]["requests"]
        for e, out, c in zip(active, outputs, caps):
            sample = out.outputs[0]
            turn = [int(t) for t in sample.token_ids]
            if not turn:
                raise RuntimeError(f"vLLM returned an empty turn for prompt {e.prompt_index} sample {e.sample_index}")
            e.tokens += turn
            e.mask += [0] * len(turn)
            e.logprobs += [min(0.0, entry[t].logprob) for t, entry in zip(turn, sample.logprobs)]
            e.hidden.append(hidden_from_bytes(taken[out.request_id]))
            e.finishes.append(finish_reason(sample.finish_reason, len(turn), c))
            obs = env.reply(e.item, e.tokens, e.mask, e.seed)
            if obs is None:
                e.done = True
            else:
                e.tokens += obs
                e.mask += [1] * len(obs)

    hidden = [torch.cat(e.hidden) for e in episodes]
    # With proofs off (benchmarks only) every chunk gets the engine's placeholder (NO_PROOF), which a verifier rejects.
    proofs = build_proofs_many(hidden) if engine.config.proofs else [[b"\x00"] * -(
        -h.shape[0] // limits.PROOF_CHUNK_TOKENS) for h in hidden]
    completions = [
        Completion(prompt_index=e.prompt_index, sample_index=e.sample_index, token_ids=np.asarray(e.tokens,
        dtype=np.int32),
                   logprobs=np.asarray(e.logprobs, dtype=np.float32), finish_reason=e.finishes[-1], proofs=p,
                   env_mask=np.asarray(e.mask, dtype=np.uint8), turn_finish_reasons=e.finishes)
        for e, p in zip(episodes, proofs)
    ]
    tokens = sum(len(e.tokens) for e in episodes)
    engine.last_stats = GenerationStats(len(completions), tokens, time.perf_counter() - started)
    return completions, hidden if return_hidden else []
