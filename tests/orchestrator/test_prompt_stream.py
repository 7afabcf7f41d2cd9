"""A procedural prompt stream in the orchestrator: fresh prompts per lease without a cap, the same prompt for the
same index after a restart, held-out prompts apart, and a curriculum moved by verified rewards that /v1/status
reports and a restarted orchestrator resumes."""

from __future__ import annotations

import numpy as np
import pytest
from orch_fakes import HASH0, FakeVerifier, encode, make_submission, run_config

from environments.curriculum import CurriculumConfig
from environments.task_api import Task, TaskItem, stream_rng
from orchestrator.data import HELD_OUT_SLOT, SLOTS, DataError, PromptStream
from orchestrator.db import Database
from orchestrator.service import Orchestrator
from orchestrator.verification import default_make_job
from protocol.models import LeaseRequest, WorkerRegistration
from trainer.tiny_model import make_tokenizer


class DigitsTask(Task):
    """Level L: copy L + 1 digits. `long_at` makes the item at that index too long to lease."""

    name = "digits"
    levels = 3
    stream = True

    def __init__(self, long_at: int = -1):
        self.long_at = long_at

    def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
        answer = "".join(stream_rng(self.name, seed, index).choice("0123456789") for _ in range(level + 1))
        prompt = f"copy:{answer * (100 if index == self.long_at else 1)}="
        return TaskItem("ignored", prompt, answer)

    def reward(self, item: TaskItem, completion_text: str) -> float:
        return float(completion_text == item.answer)


def stream(task: Task | None = None, seed: int = 7, **curriculum) -> PromptStream:
    tok = make_tokenizer()
    return PromptStream(task or DigitsTask(), lambda it: np.asarray(tok(it.prompt)["input_ids"], dtype=np.int32),
                        seed, vocab_size=64, max_tokens=32, curriculum=CurriculumConfig(**curriculum))


def test_every_position_gets_its_own_prompt_without_a_cap():
    s = stream()
    indices = [s.order(p) for p in range(5000)]
    assert indices == [p * SLOTS for p in range(5000)]  # level 0
    assert len({s.prompts[i].prompt_id for i in indices}) == 5000  # ids "p<position>-l<level>", not the task's
    assert s.prompts[indices[4321]].prompt_id == "p4321-l0"
    with pytest.raises(TypeError):
        len(s)


def test_a_restarted_stream_remakes_the_prompt_of_every_index_whatever_its_level_now():
    a, b = stream(), stream(start_level=2)
    for index in (0, 5 * SLOTS + 1, 77 * SLOTS + 2):
        pa, pb = a.prompts[index], b.prompts[index]
        assert (pa.item, pa.token_ids.tolist()) == (pb.item, pb.token_ids.tolist())
        assert len(pa.item.answer) == index % SLOTS + 1  # made at the level in its index
    assert b.order(10) == 10 * SLOTS + 2
    assert stream(seed=8).prompts[0].item.prompt != a.prompts[0].item.prompt
    with pytest.raises(IndexError):
        a.prompts[3]  # level 3 does not exist


def test_a_prompt_too_long_to_lease_is_replaced_the_same_way_every_time():
    s = stream(DigitsTask(long_at=5))
    p = s.prompts[5 * SLOTS]
    assert len(p.token_ids) <= 32 and s.dropped["too_long"] == 1
    assert stream(DigitsTask(long_at=5)).prompts[5 * SLOTS].item == p.item

    class AlwaysLong(DigitsTask):
        def item(self, seed: int, index: int, level: int = 0) -> TaskItem:
            return TaskItem("x", "copy:" + "1" * 100 + "=", "1")

    with pytest.raises(DataError, match="cannot be leased"):
        stream(AlwaysLong())  # the first prompts are made at start: a task that makes none usable stops the run


def test_held_out_prompts_sit_apart_from_training():
    s = stream().holding_out(4)
    assert s.held_out == [i * SLOTS + HELD_OUT_SLOT for i in range(4)]
    assert all(i < 2**32 for i in s.held_out) and not {s.order(p) for p in range(1000)} & set(s.held_out)
    held = [s.prompts[i] for i in s.held_out]
    assert [p.prompt_id for p in held] == [f"heldout-{i}" for i in range(4)]
    assert [p.item for p in held] == [stream().holding_out(4).prompts[i].item for i in s.held_out]


class AllRewards(FakeVerifier):
    """Every completion gets `reward` (the curriculum's input), whatever its text."""

    reward = 1.0

    def verify_many(self, jobs):
        return [v.model_copy(update={"rewards": [self.reward] * len(v.rewards)}) if v.rewards else v
                for v in super().verify_many(jobs)]


def orchestrator(tmp_path, verifier, start_level=0):
    cfg = run_config(tmp_path)
    prompts = stream(start_level=start_level, enabled=True, window=8)
    orch = Orchestrator(cfg.orchestrator, Database(cfg.orchestrator.db_path), prompts, verifier,
                        shape=cfg.step_shape(), task_name="digits", run_name=cfg.name, make_job=default_make_job)
    orch.versions.announce({0: HASH0})
    return orch


def lease_and_verify(orch, wid, rng):
    lease = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=2)).lease
    orch.admission.submit(wid, encode(make_submission(lease, rng)), None)
    while orch.verification.verify_pending():
        pass
    return lease


def test_the_curriculum_moves_on_verified_rewards_shows_in_status_and_resumes(tmp_path):
    verifier, rng = AllRewards(), np.random.default_rng(0)
    orch = orchestrator(tmp_path, verifier)
    wid = orch.authenticate(orch.register(WorkerRegistration(name="w"),
                                          orch.cfg.join_tokens[0].get_secret_value()).secret)
    assert orch.status().curriculum.model_dump() == {"level": 0, "levels": 3, "pass_rate": None, "moving": True}
    first = lease_and_verify(orch, wid, rng)  # 2 prompts x 4 samples, all passing: the window of 8 is full
    assert orch.status().curriculum.level == 1
    second = lease_and_verify(orch, wid, rng)
    assert all(len(p.token_ids) == len("copy:00=") for p in second.prompts)  # made at level 1: two digits
    assert orch.status().curriculum.level == 2
    orch.db.close()

    verifier.reward = 0.0  # a restart: the level resumes; a failing window moves it down again
    again = orchestrator(tmp_path, verifier)
    assert again.status().curriculum.level == 2
    for p in first.prompts:  # a lease in flight at the restart would be verified on the same items
        position, level = (int(x[1:]) for x in p.prompt_id.split("-"))
        assert again.prompts.prompts[position * SLOTS + level].token_ids.tolist() == p.token_ids.tolist()
    lease_and_verify(again, wid, rng)
    st = again.status().curriculum
    assert (st.level, st.pass_rate) == (1, None)
    again.db.close()


def test_a_streamed_run_evaluates_on_held_out_prompts_of_its_own(tmp_path):
    from orchestrator.config import EvalConfig
    from orchestrator.evaluation import hold_out

    cfg = run_config(tmp_path)
    orch = Orchestrator(cfg.orchestrator, Database(cfg.orchestrator.db_path), stream(), AllRewards(),
                        shape=cfg.step_shape(), task_name="digits", run_name=cfg.name, make_job=default_make_job,
                        evaluation=EvalConfig(every_steps=1, num_prompts=3))
    assert orch.evals.book is not None and orch.evals.book.prompts.held_out == [63, 127, 191]
    assert [orch.prompts.prompts[i].prompt_id for i in orch.evals.book.prompts.held_out] == [
        "heldout-0", "heldout-1", "heldout-2"]
    # What `swarmrl eval` takes as the run's held-out prompts: the same ones.
    offline = hold_out(stream(), 3, seed=7)
    assert [offline.prompts[i].item for i in offline.held_out] == [orch.prompts.prompts[i].item
                                                                  for i in orch.evals.book.prompts.held_out]
    orch.db.close()
