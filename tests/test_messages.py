"""What crosses the process boundary (`autofit.measure.messages`): one task registry, typed requests."""

import ast
import json
import re
from pathlib import Path

import pytest
from conftest import tiny_gpt_dict, write_spec

from autofit.base.errors import InputError, NonFiniteLossError, TrialError
from autofit.config.spec import load_spec
from autofit.config.train_config import TrainConfig
from autofit.device.budget import Budget
from autofit.measure import asks
from autofit.measure.fake_step import estimate_memory
from autofit.measure.memory_estimate import EstimateError, MemoryEstimate
from autofit.measure.messages import EstimateReply, EstimateRequest, SCHEMA, TaskReply, TASKS, TrialRequest
from autofit.measure.tasks import estimate as estimate_task
from autofit.measure.trial import trial_request
from autofit.measure.worker import TaskOutcome
from autofit.workload import build_workload

ROOT = Path(__file__).resolve().parents[1]
_TARGET = re.compile(r"autofit\.measure\.\w+:\w+")


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_names_a_function_of_the_measure_layer(name):
    # Resolved from the source, as the layer contract reads it: no import runs the child's code.
    module, function = TASKS[name].split(":")
    assert module.startswith("autofit.measure.")
    tree = ast.parse((ROOT / Path(*module.split("."))).with_suffix(".py").read_text())
    assert function in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_no_task_target_is_written_outside_the_registry():
    written = [f"{path.relative_to(ROOT)}: {match}" for path in sorted((ROOT / "autofit").rglob("*.py"))
               if path.name != "messages.py" for match in _TARGET.findall(path.read_text())]
    assert written == []


def test_a_trial_request_crosses_as_json_types_and_back(tmp_path):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    request = trial_request(spec, TrainConfig(micro_batch_size=8), budget=Budget(usable_bytes=2**20), claim=True)
    raw = request.to_dict()
    assert raw["schema"] == SCHEMA and raw["config"] == {"precision": "32-true", "micro_batch_size": 8,
                                                         "grad_accum_steps": 1, "checkpoint_blocks": 0,
                                                         "freeze_blocks": 0, "parallelism": "none", "world_size": 1}
    assert TrialRequest.from_dict(raw | {"_folder": "/tmp/x"}) == request  # the worker's own key is not the request's


def test_a_request_of_another_schema_is_refused_by_name(tmp_path):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    raw = trial_request(spec, TrainConfig(micro_batch_size=8)).to_dict() | {"schema": SCHEMA + 1}
    with pytest.raises(ValueError, match=f"schema {SCHEMA + 1}, this autofit reads {SCHEMA}"):
        TrialRequest.from_dict(raw)


def test_the_models_analysis_crosses_as_json_and_back_with_its_floor_typed(tmp_path):
    """The analyze task's reply, as the worker's wire carries it (JSON), read back as the
    parent's `Analysis`: the micro-batch floor a `MicroBatchFloor`, not a dict."""
    from autofit.config.train_config import MicroBatchFloor
    from autofit.measure.messages import Analysis
    from autofit.measure.tasks import analysis
    from autofit.workload import build_workload

    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict(search={"min_micro_batch_size": 2})))
    facts = analysis(spec, build_workload(spec))
    wired = json.loads(json.dumps({"status": "ok", **facts.to_dict()}))
    back = Analysis.from_dict(wired)
    assert back == facts and isinstance(back.micro_batch_floor, MicroBatchFloor)
    assert back.micro_batch_floor.size == 2 and back.n_blocks == 2 and back.chunkable


def test_an_estimate_request_of_another_schema_is_refused_by_name():
    from autofit.measure.messages import EstimateRequest

    raw = EstimateRequest(config=TrainConfig(micro_batch_size=8), device_kind="cpu").to_dict()
    assert EstimateRequest.from_dict(json.loads(json.dumps(raw))).config.micro_batch_size == 8
    with pytest.raises(ValueError, match=f"estimate request: schema {SCHEMA + 1}"):
        EstimateRequest.from_dict(raw | {"schema": SCHEMA + 1})


def test_an_estimate_reply_is_built_whole_in_the_child_and_read_back_whole(tmp_path):
    """The estimate task's reply, as the resident child's wire carries it (JSON), read back as
    the parent's `EstimateReply`: the estimate a `MemoryEstimate` equal to the fake step's,
    the largest micro batch beside it."""
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    workload = build_workload(spec)
    config = TrainConfig(micro_batch_size=8)
    request = EstimateRequest(config=config, device_kind="cpu", budget_bytes=2**30)
    wired = json.loads(json.dumps(estimate_task(request.to_dict(), {"spec": spec, "workload": workload})))
    reply = EstimateReply.from_dict(wired)
    assert reply.ok and isinstance(reply.estimate, MemoryEstimate)
    assert reply.estimate == estimate_memory(spec, config, device_kind="cpu", workload=workload)
    assert reply.max_micro_batch_size == spec.train.global_batch_size  # a GiB holds the tiny model's every size


def _outcome(reply: TaskReply | None, ended: str = "exited") -> TaskOutcome:
    result = None if reply is None else json.loads(json.dumps(reply.to_dict()))
    return TaskOutcome(ended=ended, result=result, returncode=0, log_tail="", wall_s=0.1)


def test_a_tasks_input_error_reply_is_the_parents_input_error_with_its_exit_code_and_traceback(tmp_path):
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))
    failed = EstimateReply(status="input_error", reason="model: forward raised KeyError", exit_code=2,
                           traceback="Traceback ... KeyError")
    with pytest.raises(InputError, match="forward raised KeyError") as raised:
        asks._answer(_outcome(failed), spec)
    assert raised.value.exit_code == 2 and "KeyError" in raised.value.traceback_text
    nonfinite = TaskReply(status="input_error", reason="loss is NaN", exit_code=NonFiniteLossError.exit_code)
    with pytest.raises(NonFiniteLossError):
        asks._answer(_outcome(nonfinite), spec)
    assert asks._answer(_outcome(TaskReply(status="estimate_error", reason="x")), spec).reason == "x"


@pytest.mark.parametrize("ended", ["timeout", "exited"])
def test_a_child_that_gave_no_answer_is_an_estimate_error_and_an_analysis_failure(tmp_path, monkeypatch, ended):
    """No reply at all (the child timed out, or died before writing one): the estimate is an
    `EstimateError` (the tune measures the config without a prediction) and the analysis a
    `TrialError`, each naming how the child ended; never a TypeError out of the tune."""
    spec = load_spec(write_spec(tmp_path, tiny_gpt_dict()))

    class Silent:
        def call(self, payload, **kwargs):
            return _outcome(None, ended)

        def run(self, name, payload, **kwargs):
            return _outcome(None, ended)

    monkeypatch.setattr(asks.Resident, "of", lambda worker, function: Silent())
    with pytest.raises(EstimateError, match="estimate: "):
        asks.estimate(Silent(), spec, TrainConfig(micro_batch_size=8), device_kind="cpu")
    with pytest.raises(TrialError, match="the model's analysis failed"):
        asks.analyze(Silent(), spec)
