"""A user's own model on the memory-aware runtime: a Hugging Face folder (LLaMA, Mistral, Qwen2)
loaded without torch (:mod:`.checkpoint`, :mod:`.config`), the whole model's task graph for
generation (:mod:`.graph`), greedy generation (:mod:`.generate`) and training (:mod:`.train`)
under a GPU budget; the host memory each plan needs is :mod:`vmstoolkit.exec.host_plan`."""

from vmstoolkit.exec.model.checkpoint import Checkpoint, load_model
from vmstoolkit.exec.model.config import ModelConfig

__all__ = ["Checkpoint", "ModelConfig", "load_model"]
