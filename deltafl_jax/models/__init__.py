"""Models: a Flax module plus the per-example loss and error that Delta-FL needs.

One module per job: the model type and its loss kinds (:mod:`deltafl_jax.models.model`), how
the engine runs a model's client work (:mod:`deltafl_jax.models.lane_preferences`), what a
model reads of its dataset (:mod:`deltafl_jax.models.inputs`), the built-in models on numeric
features (:mod:`deltafl_jax.models.builtin`: linear, cnn, mlp, mean), the text models
(:mod:`deltafl_jax.models.text`: gru, lstm, sent140_linear, lstm_nwp, resolved lazily), the
image models (:mod:`deltafl_jax.models.image`: fedavg_cnn, pfl_cnn, resnet18_gn, resolved lazily;
their convolutions on the fast CPU path in :mod:`deltafl_jax.models.image_conv`), the fast
path that every model's own ``nn.Conv`` and ``nn.max_pool`` layers take
(:mod:`deltafl_jax.models.conv_intercept`), the local
steps' augmentation (:mod:`deltafl_jax.models.augment`) and the registry
(:mod:`deltafl_jax.models.registry`). Their public names are imported from here.

Models are looked up by name with :func:`build_model`.

Your own model (a Flax module with its loss and error) is a factory ``(data, options) ->
Model`` registered under a name with :func:`register_model` (``deltafl_jax.register_model``);
``--model=NAME`` (or ``ExperimentConfig(model=NAME)``) then trains it, and
``experiments.run --model_module=FILE_OR_MODULE`` imports the module that registers it. The
documentation's *Your own model* guide (docs/guides/own-model.md) has the recipe;
``tests/test_custom_model.py`` trains one defined outside the package.
"""

from deltafl_jax.models.builtin import MLP, ConvNet, Linear, Mean
from deltafl_jax.models.conv import default_conv_impl
from deltafl_jax.models.inputs import (NO_BIAS_DATASETS, is_token_data, linear_bias,
                                       numeric_features)
from deltafl_jax.models.lane_preferences import LanePreferences
from deltafl_jax.models.model import (LOSS_KINDS, Model, ModelOptions, Params,
                                      sequence_losses_and_errors)
from deltafl_jax.models.registry import (BUILT_IN, LAZY_MODELS, LINEAR_MODELS, MODELS,
                                         REGRESSION_MODELS, build_model, model_names,
                                         register_model)

__all__ = ["BUILT_IN", "ConvNet", "LAZY_MODELS", "LINEAR_MODELS", "LOSS_KINDS", "LanePreferences",
           "Linear", "MLP", "MODELS", "Mean", "Model", "ModelOptions", "NO_BIAS_DATASETS",
           "Params", "REGRESSION_MODELS", "build_model", "default_conv_impl", "is_token_data",
           "linear_bias", "model_names", "numeric_features", "register_model",
           "sequence_losses_and_errors"]
