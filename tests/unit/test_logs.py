import json

import structlog

from astraflow import logs


def test_json_lines_off_a_tty_with_worker_and_run_bound(capsys):
    logs.configure(worker="raas-1", run="demo")
    try:
        structlog.get_logger("t").info("batch_published", model="policy", size=8)
    finally:
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "batch_published" and line["size"] == 8
    assert (line["worker"], line["run"], line["level"]) == ("raas-1", "demo", "info")
