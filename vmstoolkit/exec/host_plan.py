"""Host memory, planned before anything is allocated.

A memory graph says everything the host will hold during a run, so the figure is computed, not
discovered by the kernel's OOM killer (issue 32: a 13B-width full fine-tune was killed after
228 s with no message). :func:`host_plan` adds, in bytes:

- ``weights``: weight values held in RAM. A float32 weight of a checkpoint is a view of the
  memory-mapped file (page cache the kernel can drop and reread, not a copy) unless the backend
  must pin it: the cuda backend's ``pin="in_place"`` replaces each by one pinned copy, once.
- ``state``: the other inputs (token ids; for training, x, dout) and the AdamW moments, one copy.
- ``outputs``: what the run hands back (updated weights and moments, logits, tokens), one array each.
- ``offload``: one host slot per offloaded activation (each is offloaded at most once; the
  compiler keeps a clean host copy after that).
- ``reference``: with a gradient check on the cuda backend, the direct all-on-GPU run's outputs
  read back beside the plan's (as many bytes as ``outputs``).
- ``staging`` (inside the figures above, not added again): the pinned slots of the cuda
  backend's :class:`~vmstoolkit.exec.backends.host_memory.PinnedPool`: one per offloaded
  activation, plus what ``pin`` copies into slots (``"copy"``: every weight and input;
  ``"register"``: the inputs and the weights below ``REGISTER_MIN_BYTES``; ``"in_place"``:
  nothing). The runs give it to the pool as its hard bound (``PinnedPool(limit_bytes=)``), so
  pinned staging never grows past the plan.
- ``device_model``: the sim backend with numerics holds each GPU's region as a zeroed byte
  array of the budget's size, of which the pages up to the highest byte the plan places are
  touched (counted here; the rest stays unbacked), and a copy of every value: the simulated GPU
  lives in host RAM.

:func:`check_host_budget` refuses a plan above the budget in one line, such as ``needs 71.2 GiB
of host memory (weights 26.0 GiB, optimizer state 26.0 GiB, ...), 58.0 GiB available
(--host-budget)``. :func:`default_host_budget` is the machine's available memory less a margin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vmstoolkit.exec.errors import HostBudgetError
from vmstoolkit.exec.graph import TensorKind

TRAIN_LABELS = {"weights": "weights", "state": "optimizer state and inputs", "outputs": "updated weights and moments",
                "offload": "offloaded activations and gradients"}  # what the parts hold in a training step
MARGIN_FRACTION = 0.10  # of available memory kept free for the interpreter, numba and the OS
MARGIN_MIN = 2 << 30


@dataclass(frozen=True)
class HostPlan:
    weights: int = 0
    state: int = 0
    outputs: int = 0
    offload: int = 0
    device_model: int = 0
    reference: int = 0
    staging: int = 0  # pinned slots, already counted in the figures above (module docstring)

    @property
    def total(self) -> int:
        return self.weights + self.state + self.outputs + self.offload + self.device_model + self.reference

    def as_row(self) -> dict:
        return {"host_plan_bytes": self.total, "host_weights_bytes": self.weights, "host_state_bytes": self.state,
                "host_outputs_bytes": self.outputs, "host_offload_bytes": self.offload,
                "host_device_model_bytes": self.device_model, "host_reference_bytes": self.reference,
                "host_staging_bytes": self.staging}


def host_plan(mg, *, mapped: set[int] = frozenset(), pinned_copies: bool = False, sim_numerics: bool = False,
              reference: bool = False, materialized: bool = True, pin: str | None = None) -> HostPlan:
    """The host bytes of running memory graph ``mg`` (module docstring). ``mapped``: weight
    tensors whose values are views of a memory-mapped file; ``pinned_copies``: the backend pins a
    copy of each (cuda), so mapped weights cost RAM too. ``materialized=False``: the run holds no
    values at all (the sim backend timing a plan without numerics): nothing. ``pin``: the cuda
    backend's pin mode, for ``staging`` (None: offload slots only)."""
    if not materialized:
        return HostPlan()
    g = mg.graph
    weights = state = 0
    for t in g.tensors:
        if t.kind is TensorKind.WEIGHT and t.name.endswith((".adam_m", ".adam_v")):
            state += t.nbytes  # AdamW moments: weights of the graph, optimizer state of the run
        elif t.kind is TensorKind.WEIGHT:
            if pinned_copies or t.id not in mapped:
                weights += t.nbytes
        elif t.kind is TensorKind.INPUT:
            state += t.nbytes
    outputs = sum(g.tensors[t].nbytes for t in g.outputs)
    offload = sum(v.nbytes for v in mg.vertices if v.kind == "offload")
    staging = offload
    if pin in ("copy", "register"):
        from vmstoolkit.exec.backends.host_memory import REGISTER_MIN_BYTES

        staging += sum(t.nbytes for t in g.tensors if t.kind is TensorKind.INPUT
                       or (t.kind is TensorKind.WEIGHT and (pin == "copy" or t.nbytes < REGISTER_MIN_BYTES)))
    device = 0
    if sim_numerics:
        top = [0] * mg.n_gpus
        for b in mg.buffers:
            top[b.gpu] = max(top[b.gpu], b.offset + b.size)
        device = sum(top) + sum(t.nbytes for t in g.tensors if t.kind is not TensorKind.ACTIVATION)
    return HostPlan(weights, state, outputs, offload, device, outputs if reference else 0, staging)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_host_budget() -> int | None:
    """Available memory less max(10%, 2 GiB); None where it cannot be read (no check then)."""
    avail = available_memory()
    if avail is None:
        return None
    return max(0, avail - max(int(avail * MARGIN_FRACTION), MARGIN_MIN))


def check_host_budget(plan: HostPlan, budget: int | None, *, labels: dict[str, str] | None = None) -> None:
    """Raise :class:`HostBudgetError` (one line) when ``plan`` needs more than ``budget`` bytes."""
    if budget is None or plan.total <= budget:
        return
    from vmstoolkit.units import format_size

    names = {"weights": "weights", "state": "inputs", "outputs": "outputs", "offload": "offloaded activations",
             "device_model": "the simulated GPU", "reference": "the gradient check's reference"} | (labels or {})
    parts = [f"{names[k]} {format_size(getattr(plan, k))}" for k in names if getattr(plan, k)]
    raise HostBudgetError(f"needs {format_size(plan.total)} of host memory ({', '.join(parts)}), "
                          f"{format_size(budget)} available (--host-budget)")
