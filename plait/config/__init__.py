"""Configuration: typed dataclasses, TOML loading, `--set a.b=c` overrides, validation.

schema.py holds the dataclasses, loading and overrides; checks.py the steps of
`Config.validate()`; values.py the one parser of a value against its field's type. Each
parallel dimension's own checks are in its record (plait/dims/). Pure Python, no torch
(tests/test_layering.py). The public names are here, so `from plait.config import Config`
does not depend on that split.
"""

from plait.config.schema import (
    FIRST_BUCKET_MB,
    ZERO_REDUCE_SCATTERS_IN_FLIGHT,
    Config,
    ConfigError,
    ParallelConfig,
    TrainConfig,
    load_config,
    set_value,
)
from plait.dims import DEFAULT_ORDER, DIMS

__all__ = ["DEFAULT_ORDER", "DIMS", "FIRST_BUCKET_MB", "ZERO_REDUCE_SCATTERS_IN_FLIGHT",
           "Config", "ConfigError", "ParallelConfig", "TrainConfig", "load_config",
           "set_value"]
