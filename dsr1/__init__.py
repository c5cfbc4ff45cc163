"""dsr1: DeepSeek-V3/R1 inference in pure JAX.

The everyday API::

    import dsr1
    model = dsr1.load(dsr1.demo_checkpoint())   # the embedded demo model; or a release folder, e.g. /ckpt/DeepSeek-R1
    out = dsr1.generate(model, ["Why is the sky blue?"], chat=True, sampling=dsr1.Sampling(temperature=0.6))

A loaded model carries its folder's tokenizer (`model.tokenizer`), which `generate` and
`serving.Engine` use by default.

The package reads as the data flow: `core` (the model as pure functions on a mesh), `weights`
(checkpoints on disk), `programs` (the jitted entry points), `api` (`Model`, `load`,
`init_random`), `generation` (tokenizer, sampling, generate), `serving` (`dsr1.serving.Engine`:
continuous batching, prefix cache), `workbench` (cluster, widgets, profiles) and `bench`
(benchmarks, `python -m dsr1.bench`).
"""

__version__ = "0.1.0"

from . import serving
from .api import Model, init_random, load
from .core.cache import KVCache
from .core.config import Config, ConfigError
from .core.sharding import ShardingRules, layout_rules, make_mesh
from .generation.batch import Completion, GenerationResult, generate
from .generation.sampling import Sampling
from .generation.tokenizer import Tokenizer, load_tokenizer
from .weights.convert import ConversionError
from .weights.demo import demo_checkpoint
from .weights.safetensors_io import CheckpointError

__all__ = [
    "CheckpointError", "Completion", "Config", "ConfigError", "ConversionError", "GenerationResult", "KVCache",
    "Model", "Sampling", "ShardingRules", "Tokenizer", "__version__", "demo_checkpoint", "generate", "init_random",
    "layout_rules", "load", "load_tokenizer", "make_mesh", "serving",
]
