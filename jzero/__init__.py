"""jzero: DeepSpeed's training engine on JAX/XLA. ZeRO stages 0-3 are sharding rules."""
from jzero.adapters import from_linen, from_nnx
from jzero.checkpoint import CheckpointError, CheckpointMismatchError, Checkpointer, CheckpointWarning
from jzero.config import Config, ConfigError, ConfigWarning, load_config
from jzero.export import export, load_params
from jzero.mesh import make_mesh
from jzero.sharding import Plan
from jzero.state import TrainState, abstract_init, init
from jzero.step import train_step

__version__ = "0.1.0"

__all__ = ["CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "Checkpointer", "Config", "ConfigError",
           "ConfigWarning", "Plan", "TrainState", "abstract_init", "export", "from_linen", "from_nnx", "init",
           "load_config", "load_params", "make_mesh", "train_step", "__version__"]
