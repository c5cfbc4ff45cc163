"""dsr1: DeepSeek-V3/R1 inference in pure JAX."""

from .api import Model, init_random, load
from .cache import KVCache
from .config import Config, ConfigError
from .safetensors_io import CheckpointError
from .sharding import make_mesh

__all__ = ["CheckpointError", "Config", "ConfigError", "KVCache", "Model", "init_random", "load", "make_mesh"]
__version__ = "0.1.0"
