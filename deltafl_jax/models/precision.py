"""Mixed precision: the ``--compute_dtype`` of a run's forward and backward passes.

``float32`` (the default) leaves every model as it is: nothing is cast, and every result of an
earlier version is unchanged bit for bit. ``bfloat16`` runs the matrix products and the
convolutions in bfloat16 while everything the algorithms own stays float32: the parameters
(the master copy that local SGD updates), the optimizer states, the aggregation, the
superquantile, clipping and DP noise (Micikevicius et al. 2018, "Mixed Precision Training",
Sec. 3: a float32 master copy of the weights, products in half precision; bfloat16 keeps
float32's exponent range, so no loss scaling is needed).
"""

from __future__ import annotations

import dataclasses

from deltafl_jax.declared import setting
from deltafl_jax.errors import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtype of the models' matrix products and convolutions (``config.precision``).

    Attributes:
      compute_dtype: float32 | bfloat16 (parameters, optimizer states and the aggregation stay
        float32 either way).
    """

    compute_dtype: str = setting(
        "float32", "dtype of the models' matrix products and convolutions: float32 | bfloat16 "
        "(parameters, optimizer states, the aggregation, the superquantile, clipping and DP "
        "noise stay float32)", choices=COMPUTE_DTYPES)

    def check(self) -> None:
        """ConfigError naming the flag of a bad setting."""
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"--compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                              f"got {self.compute_dtype!r}")
