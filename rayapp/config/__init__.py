"""rayapp's settings: the engine's frozen dataclasses (`rayapp.config.engine`) and the Serve
application's Pydantic models that validate `rayapp.config.yaml` (`rayapp.config.app`)."""

from rayapp.config.app import AppConfig
from rayapp.config.engine import (
    DTYPE_OPTIONS,
    DTYPES,
    REPRESENTATIONS,
    RETRIEVALKV_DEFAULTS,
    SPARSE_ENV,
    CacheConfig,
    EngineConfig,
    KVTierConfig,
    LayerwiseConfig,
    ModelConfig,
    SchedulerConfig,
    SparseConfig,
)
from rayapp.config.sections import (
    AutoscalingSettings,
    KVTierSettings,
    LayerwiseSettings,
    LimitSettings,
    RouterConfig,
    SparseSettings,
)

__all__ = [
    "DTYPE_OPTIONS",
    "DTYPES",
    "REPRESENTATIONS",
    "RETRIEVALKV_DEFAULTS",
    "SPARSE_ENV",
    "AppConfig",
    "AutoscalingSettings",
    "CacheConfig",
    "EngineConfig",
    "KVTierConfig",
    "KVTierSettings",
    "LayerwiseConfig",
    "LayerwiseSettings",
    "LimitSettings",
    "ModelConfig",
    "RouterConfig",
    "SchedulerConfig",
    "SparseConfig",
    "SparseSettings",
]
