"""Steps sent to a worker from synchronous test code, on its StreamSteps stream as an engine loop sends them."""

from __future__ import annotations

from protos import worker_pb2, worker_pb2_grpc


def execute_steps(stub: worker_pb2_grpc.WorkerStub, plans: list[worker_pb2.StepPlan],
                  timeout: float) -> worker_pb2.StepBatchResult:
    """One call of `plans` on a stream of its own; a failed call raises grpc.RpcError with its status."""
    (answer,) = stub.StreamSteps(iter([worker_pb2.StepBatch(steps=plans)]), timeout=timeout)
    return answer


def execute_step(stub: worker_pb2_grpc.WorkerStub, plan: worker_pb2.StepPlan, timeout: float) -> worker_pb2.StepResult:
    """One plan's result (see execute_steps)."""
    return execute_steps(stub, [plan], timeout).results[0]
