"""Start-up of `python -m arfusion.engine.launch_server`: a model path that does not exist is named as such,
the start-up line states the fusion status once, and the test helper leaves no log file."""
import tempfile
from pathlib import Path

import pytest

from arfusion.engine.server.rank0 import fusion_summary
from tests.server_process import EXIT_TIMEOUT_S, ServerProcess

pytestmark = pytest.mark.timeout(300)


def test_a_model_path_that_does_not_exist_is_named_and_leaves_no_log_file():
    server = ServerProcess("--model-path", "/nonexistent/model", wait_healthy=False)
    try:
        assert server.proc.wait(timeout=EXIT_TIMEOUT_S) == 2
    finally:
        server.kill()
    log = server.log_text()
    assert "--model-path '/nonexistent/model': no such file or directory" in log, log
    assert "tokenizer" not in log and "Traceback" not in log, log
    assert not list(Path(tempfile.gettempdir()).glob(f"arfusion-server-{server.port}*")), "a log file was left"


@pytest.mark.parametrize("status, line", [
    ({"active": True, "reason_inactive": None}, "all-reduce fusion active"),
    ({"active": False, "reason_inactive": "fusion is not enabled (--enable-flashinfer-allreduce-fusion)"},
     "all-reduce unfused: fusion is not enabled (--enable-flashinfer-allreduce-fusion)"),
    ({"active": False, "reason_inactive": "TP size is 1: there is nothing to all-reduce"},
     "all-reduce unfused: TP size is 1: there is nothing to all-reduce"),
])
def test_the_startup_line_states_the_fusion_status_once(status, line):
    assert fusion_summary(status) == line
