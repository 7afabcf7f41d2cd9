"""A worker that steers among the tokens the tolerances accept (tools/steering_attacks.py) is accepted by the
real Verifier, but every token it moved off the exact draw is counted, and the allowance it is held to is
the dtype's rate times the positions that offered a choice."""

from __future__ import annotations

import random

from environments.tasks import get_task
from protocol.models import SamplingParams
from protocol.verdicts import VerdictStatus
from tools.steering_attacks import Attacker, _job
from tools.verifier_calibration import encode_prompts, lease_for
from verifier.config import VerifierConfig
from verifier.service import Verifier


def test_steered_tokens_are_accepted_but_every_one_is_counted(tiny_model_dir):
    # bf16 on a random model's flat distributions: its tolerances leave a second token at many positions.
    verifier = Verifier(VerifierConfig(dtype="bfloat16", keep_versions=1), lambda v: tiny_model_dir, tiny_model_dir)
    task, rng = get_task("toy"), random.Random(0)
    sampling = SamplingParams(temperature=1.0, top_k=20, max_tokens=12)
    try:
        items = task.make_prompts(12, 1)
        steered = 0
        for i, (item, prompt) in enumerate(zip(items, encode_prompts(tiny_model_dir, items))):
            lease = lease_for(prompt, sampling, rng.randrange(1 << 63), f"steer{i}")
            attacker = Attacker(verifier, task, item, prompt, lease.prompts[0].seeds[0], sampling)
            s, _ = attacker.steer(None)
            if not s.deviations:
                continue
            steered += 1
            (v,) = verifier.verify_many([_job(verifier, lease, item, prompt, s.tokens, i)])
            assert v.status == VerdictStatus.accepted, v.rejections
            assert v.near_ties >= s.deviations  # each moved token counted (noise may add its own)
            assert 0 < v.near_tie_allowance <= verifier.tolerances.deviation_rate * len(s.tokens)
        assert steered >= 2
    finally:
        verifier.close()
