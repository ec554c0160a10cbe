"""Run Hugging Face / Accelerate training scripts on Megatron-Core parallelism."""

import warnings

# megatron-core warns at import that TE/apex are absent; they are optional accelerators here.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*apex.*", category=UserWarning)

from .errors import MegatronPluginConfigError  # noqa: E402
from .plugin import MegatronLMPlugin  # noqa: E402

__all__ = ["MegatronLMPlugin", "MegatronPluginConfigError"]
__version__ = "0.1.0"
