from __future__ import annotations

import json
import logging

from swarmrl.logs import JsonFormatter, KeyValueFormatter, configure_logging


def test_json_lines_carry_structured_fields():
    record = logging.makeLogRecord({"name": "swarmrl.test", "levelname": "WARNING", "levelno": 30,
        "msg": "lease %s expired", "args": ("l-1",), "worker_id": "w-7"})
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "lease l-1 expired" and out["level"] == "warning" and out["worker_id"] == "w-7"


def test_text_format_and_levels(capsys):
    configure_logging("WARNING", "text")
    log = logging.getLogger("swarmrl.test")
    log.info("hidden")
    log.warning("shown", extra={"step": 3})
    err = capsys.readouterr().err
    assert "hidden" not in err and "shown" in err and "step=3" in err
    assert isinstance(logging.getLogger().handlers[0].formatter, KeyValueFormatter)
    configure_logging("INFO", "json")
    assert isinstance(logging.getLogger().handlers[0].formatter, JsonFormatter)
