"""Base models are made once per machine: the second identical request is a copy, another request is made."""

from __future__ import annotations

import pytest

from trainer import model_cache, tiny_model


def digest(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_the_second_identical_model_is_a_copy_and_another_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", str(tmp_path / "cache"))
    made = []
    make = tiny_model._make_model
    monkeypatch.setattr(tiny_model, "_make_model", lambda out, **kw: made.append(kw) or make(out, **kw))
    a = tiny_model.init_model(tmp_path / "a", "tiny", seed=3)
    b = tiny_model.init_model(tmp_path / "b", "tiny", seed=3)
    assert len(made) == 1 and digest(a) == digest(b)
    assert model_cache.COMPLETE not in digest(b)
    tiny_model.init_model(tmp_path / "c", "tiny", seed=4)
    assert len(made) == 2


def test_an_entry_cut_short_is_made_again_and_off_means_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", str(tmp_path / "cache"))
    calls = []

    def make(out):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    key = "test-key"
    (tmp_path / "cache" / key).mkdir(parents=True)  # a copy killed before its marker
    (tmp_path / "cache" / key / "config.json").write_text("partial")
    model_cache.cached_model(tmp_path / "a", key, make)
    assert len(calls) == 1 and (tmp_path / "a" / "config.json").read_text() == "{}"
    assert (tmp_path / "cache" / key / "config.json").read_text() == "{}"  # the damaged entry replaced
    monkeypatch.setenv("SWARMRL_MODEL_CACHE", "off")
    model_cache.cached_model(tmp_path / "b", "other", make)
    assert len(calls) == 2 and not (tmp_path / "cache" / "other").exists()


@pytest.mark.parametrize("change", ["args", "source"])
def test_the_key_follows_the_arguments_and_the_source(tmp_path, change):
    src = tmp_path / "maker.py"
    src.write_text("x = 1")
    before = model_cache.cache_key("tiny", {"seed": 1}, [src])
    if change == "args":
        after = model_cache.cache_key("tiny", {"seed": 2}, [src])
    else:
        src.write_text("x = 2")
        after = model_cache.cache_key("tiny", {"seed": 1}, [src])
    assert before != after
