"""Every error the runtime raises on purpose is an ExecError (a VmsError), one line, naming the
value; bad input keeps ValueError as a second base (issue 19, one error family)."""

import asyncio

import numpy as np
import pytest

from tests.exec.helpers import tiny_llama
from vmstoolkit.errors import DriverError, VmsError
from vmstoolkit.exec.backends.sim import SimBackend
from vmstoolkit.exec.compiler import compile_memory_graph, working_set
from vmstoolkit.exec.errors import ExecError, ExecutionError, InvalidGraphError, InvalidOptionError, InvalidShapeError
from vmstoolkit.exec.executor import execute, execute_async
from vmstoolkit.exec.experiment import run_offload_experiment
from vmstoolkit.exec.graph import LlamaConfig, TaskGraph, TensorKind
from vmstoolkit.exec.ops import run_op
from vmstoolkit.exec.plan_cache import bucket_edge
from vmstoolkit.exec.train_experiment import BudgetSpecError, parse_budget, run_train_experiment, step_lengths
from vmstoolkit.exec.train_graph import build_train_step

TINY = LlamaConfig(n_blocks=1, seq=16, hidden=64, heads=4, kv_heads=4, ffn=128)


def _graph_reading_an_unwritten_tensor():
    g = TaskGraph()
    x = g.tensor("x", (4, 4))
    y = g.tensor("y", (4, 4))
    g.add("add", "residual_add", [x, x], [y])


def _graph_writing_twice():
    g = TaskGraph()
    x = g.tensor("x", (4, 4), kind=TensorKind.INPUT)
    y = g.tensor("y", (4, 4))
    g.add("a", "residual_add", [x, x], [y])
    g.add("b", "residual_add", [x, x], [y])


def _unknown_op():
    g = TaskGraph()
    x = g.tensor("x", (4, 4), kind=TensorKind.INPUT)
    g.add("a", "conv3d", [x], [g.tensor("y", (4, 4))])


def _numpy_op_missing():
    from types import SimpleNamespace

    v = SimpleNamespace(name="v", op="no-such-op", params={}, inputs=[0], outputs=[1], views=((2,), (2,)))
    run_op(v, [np.zeros(2)])


def _fewer_gpus_than_the_graph():
    compile_memory_graph(tiny_llama(n_gpus=2, n_blocks=2), 10**9, n_gpus=1)


def _sim_numerics_without_values():
    mg = compile_memory_graph(tiny_llama(), 10**9)
    SimBackend(numerics=True).setup(mg)


def _unknown_executor():
    execute(compile_memory_graph(tiny_llama(), 10**9), SimBackend(), "eager")


BAD_INPUT = [
    (_graph_reading_an_unwritten_tensor, InvalidGraphError, "before it is written"),
    (_graph_writing_twice, InvalidGraphError, "written twice"),
    (_unknown_op, InvalidGraphError, "conv3d"),
    (_numpy_op_missing, InvalidGraphError, "no-such-op"),
    (_fewer_gpus_than_the_graph, InvalidGraphError, "2 GPUs, compiling for 1"),
    (_sim_numerics_without_values, InvalidOptionError, "host values"),
    (_unknown_executor, InvalidOptionError, "'eager'"),
    (lambda: run_offload_experiment("tpu", config=TINY), InvalidOptionError, "'tpu'"),
    (lambda: run_train_experiment("tpu", config=TINY, seq=16, steps=1), InvalidOptionError, "'tpu'"),
    (lambda: build_train_step(TINY, "qlora"), InvalidOptionError, "'qlora'"),
    (lambda: build_train_step(TINY, "lora", rank=0), InvalidShapeError, "rank"),
    (lambda: step_lengths(16, (1, 2), None), InvalidOptionError, "not both"),
    (lambda: step_lengths(None, (5, 2), None), InvalidShapeError, "5:2"),
    (lambda: step_lengths(0, None, None), InvalidShapeError, "got 0"),
    (lambda: bucket_edge(0), InvalidShapeError, "got 0"),
    (lambda: bucket_edge(300, max_seq=100), InvalidShapeError, "max_seq=100"),
    (lambda: bucket_edge(10, granule=0), InvalidOptionError, "granule=0"),
    (lambda: parse_budget("2.0", lambda: 100), BudgetSpecError, "'2.0'"),
    (lambda: parse_budget("12 parsecs", lambda: 100), BudgetSpecError, "parsecs"),
]


@pytest.mark.parametrize("call,error,needle", BAD_INPUT, ids=lambda x: getattr(x, "__name__", None))
def test_bad_input_is_an_exec_error_and_a_value_error(call, error, needle):
    with pytest.raises(error, match=needle) as e:
        call()
    assert isinstance(e.value, ExecError) and isinstance(e.value, VmsError) and isinstance(e.value, ValueError)
    assert "\n" not in str(e.value)


def test_execute_inside_a_running_loop_is_an_execution_error():
    mg = compile_memory_graph(tiny_llama(), working_set(tiny_llama()))

    async def main():
        with pytest.raises(ExecutionError, match="await execute_async") as e:
            execute(mg, SimBackend())
        assert isinstance(e.value, RuntimeError)
        await execute_async(mg, SimBackend())

    asyncio.run(main())


def test_a_failed_driver_call_is_an_exec_error_naming_the_cuda_result():
    from vmstoolkit.exec.errors import CudaCallError

    e = CudaCallError("CUDA_ERROR_INVALID_HANDLE", "cuLaunchHostFunc on stream 0x10")
    assert isinstance(e, ExecError) and isinstance(e, DriverError) and e.result == "CUDA_ERROR_INVALID_HANDLE"
    assert str(e) == "CUDA_ERROR_INVALID_HANDLE: cuLaunchHostFunc on stream 0x10"


def test_train_offload_budgets_are_read_as_experiment_offload_reads_them():
    """One budget syntax: sizes need a unit, fractions may be given in percent; training takes
    fractions up to 1 (the working set)."""
    assert parse_budget("50%", lambda: 1000) == parse_budget("0.5", lambda: 1000) == 500
    assert parse_budget("1", lambda: 1000) == 1000  # the whole working set, not one byte
    assert parse_budget("300KiB", lambda: 1000) == parse_budget(300 * 1024, lambda: 1000) == 300 * 1024
    with pytest.raises(BudgetSpecError, match="unit"):
        parse_budget("123456", lambda: 1000)
