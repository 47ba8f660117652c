"""The engine's default slots and policy as the server passes them on: Triton's model parameters leave the choice
to the model, and `dspark serve` says what it chose at startup (tests/runtime/test_engine_choice.py: the choice)."""
import pytest

from dspark.errors import DSparkError
from dspark.runtime.engine_choice import CPU_SLOTS
from dspark.serve.triton import TritonModel

from serve_support import start_server


def test_triton_parameters_leave_the_choice_to_the_model_by_default(tmp_path):
    params = TritonModel(bundle=tmp_path).parameters()
    assert (params["batch_size"], params["policy"]) == ("auto", "auto")
    named = TritonModel(bundle=tmp_path, batch_size=2, policy="schedule+gate").parameters()
    assert (named["batch_size"], named["policy"]) == ("2", "schedule+gate")
    with pytest.raises(DSparkError):
        TritonModel(bundle=tmp_path, policy="sometimes").parameters()


def test_serve_says_what_it_chose_at_startup(calibrated, tmp_path):
    server = start_server(calibrated, tmp_path / "server.log", "--model-name", "tiny")
    try:
        metrics = server.get("/metrics").text
    finally:
        assert server.stop() == 0
    log = server.log.read_text()
    assert f"dspark serve: {CPU_SLOTS} batch slots (the CPU default" in log
    assert "policy schedule+gate (the bundle's SPS table covers 8 batch tokens)" in log
    assert f"dspark_slots {CPU_SLOTS:.1f}" in metrics
