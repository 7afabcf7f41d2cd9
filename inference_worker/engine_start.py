"""Starting the worker's vLLM engine.

A worker given its base model folder (`--model`, as `swarmrl run` gives its local workers) starts the engine
from it at once, in a thread, so the start (~20-30 s on 2 CPU cores for the demo's model, more at real sizes)
overlaps registration and the download of the first policy version. The engine serves no lease before a
version is loaded into it (its policy_version is None until then), so the base weights never reach a
submission. Without `--model` it starts the same way from the config and tokenizer the run serves
(base_model.py), on dummy weights; from a run that serves none, from the first version folder once downloaded.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

from inference_worker.config import EngineConfig, WorkerConfig

log = logging.getLogger(__name__)


def engine_config_for(base: EngineConfig, version_dir: Path | None) -> EngineConfig:
    """The engine settings a version needs: a run that publishes LoRA adapters needs LoRA on from the start,
    at least at their rank."""
    if version_dir is None or base.max_lora_rank:
        return base
    from shardcast.adapter import is_adapter, load_version, unpack_adapter

    if not is_adapter(version_dir):
        return base
    _, adapter_config, _ = unpack_adapter(load_version(version_dir))
    return base.model_copy(update={"max_lora_rank": int(adapter_config["r"])})


class EngineStarter:
    def __init__(self, config: WorkerConfig, factory: Callable[[str, EngineConfig], Any] | None = None):
        self.config = config
        self.model = config.model
        self.weightless = False  # the model folder came from the run (base_model.py): config and tokenizer only
        self.factory = factory
        self._early: Any = None
        self._early_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start_early(self) -> None:
        if not self.model or self._thread is not None:
            return

        def build() -> None:
            try:
                self._early = self._build(self.model, self.config.engine)
            except BaseException as exc:  # raised again when the loop asks for the engine
                self._early_error = exc

        self._thread = threading.Thread(target=build, name="engine-start", daemon=True)
        self._thread.start()

    def engine_for(self, version_dir: Path) -> Any:
        """An engine to load `version_dir` into: the early one when its settings suit the version."""
        model = self.model or str(version_dir)
        if not self.model and not (version_dir / "config.json").is_file():
            raise SystemExit("the weights folder has no config.json: pass --model <base model folder or hub id>")
        wanted = engine_config_for(self.config.engine, version_dir)
        if self.weightless and wanted.max_lora_rank:
            raise SystemExit("this run publishes LoRA adapters, which need the base model's weights: "
                             "pass --model <base model folder or hub id>")
        if self._thread is not None:
            self._thread.join()
            self._thread, early, self._early = None, self._early, None
            if self._early_error is not None:
                raise self._early_error
            if wanted == self.config.engine:
                return early
            log.info("the first version is a LoRA adapter: restarting the engine with LoRA on")
            if hasattr(early, "close"):
                early.close()
        return self._build(model, wanted)

    def close(self) -> None:
        """An early engine nobody took (the worker stopped before its first version)."""
        if self._thread is not None:
            self._thread.join()
            if self._early is not None and hasattr(self._early, "close") and self.factory is None:
                self._early.close()
            self._thread = self._early = None

    def _build(self, model: str, engine_config: EngineConfig) -> Any:
        if self.factory is not None:
            return self.factory(model, engine_config)
        from inference_worker.engine import RolloutEngine

        return RolloutEngine(model, engine_config, dummy_weights=self.weightless)

    def use_run_model(self, folder: Path) -> None:
        """Start from the config and tokenizer the run served (no weights: the first version brings them)."""
        self.model, self.weightless = str(folder), True
        self.start_early()

