"""axolotl plugin: `optimizer: <base>_layerwise` in an axolotl YAML trains layer-wise.

```yaml
plugins:
  - layerwise_hf.integrations.axolotl.LayerwisePlugin
optimizer: adamw_8bit_layerwise
layerwise_clip: exact  # optional: exact (the default), previous, per_param or off
```

axolotl builds its own `AxolotlTrainingArguments` and `AxolotlTrainer` (subclasses of transformers' classes) from the
YAML, and passes `optimizer` to them as `optim`. The plugin calls `layerwise_hf.install()` from `register()`, the first
hook, which axolotl runs as it loads the config, before anything is built: from then on those classes accept the name
and the trainer is made `(LayerwiseTrainerMixin, AxolotlTrainer)`, as with `python -m layerwise_hf`.
`post_trainer_create` checks that it was; `post_train_unload` uninstalls.

NOTE: `BasePlugin.create_optimizer` is not the way in: axolotl 0.19.0 defines `PluginManager.create_optimizer` but
never calls it, and an optimizer alone would leave out the rest of the mixin (the norm pass of exact clipping,
Trainer's grad-norm calls, the layer-wise checkpoint files).

Imported only by axolotl (it resolves the `plugins:` entry); without axolotl the class is a plain object, so that the
hook logic can be tested without it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..bases.registry import is_layerwise_name, parse_optim_name
from ..optim.clipping import CLIP_MODES, ClipMode
from . import patching

try:
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel, Field
except ImportError:  # axolotl is not installed: the hooks are still importable and testable
    BasePlugin = object
    BaseModel = None

logger = logging.getLogger(__name__)
REPORT_LOGGER = "axolotl.integrations.layerwise_hf"

PLUGIN = "layerwise_hf.integrations.axolotl.LayerwisePlugin"

# axolotl settings that its own `create_optimizer` reads (core/trainers/mixins/optimizer.py). The layer-wise mixin
# builds the optimizer instead, so they would be ignored without a word: refused before anything loads.
IGNORED_BY_LAYERWISE = {
    "embedding_lr": "a learning rate for the embeddings",
    "embedding_lr_scale": "a learning-rate scale for the embeddings",
    "lr_groups": "per-module learning-rate groups",
    "loraplus_lr_ratio": "LoRA+ learning rates",
}

if BaseModel is not None:

    class LayerwiseArgs(BaseModel):
        """The plugin's keys in an axolotl YAML (merged into axolotl's config schema)."""

        layerwise_clip: str | None = Field(
            default=None,
            json_schema_extra={
                "description": "How max_grad_norm is applied with a layer-wise optimizer: "
                + ", ".join(CLIP_MODES)
                + " (default exact)."
            },
        )


def layerwise_settings(cfg: Mapping) -> dict | None:
    """
    What the plugin does for an axolotl config (the raw YAML as a mapping): `None` when `optimizer` is not a
    layer-wise name (the plugin changes nothing), else the keyword arguments for `layerwise_hf.install()`.

    Raises:
        ValueError: an unknown layer-wise name (listing the valid ones), a wrong `layerwise_clip`, or a setting that
            axolotl's own optimizer code reads and a layer-wise optimizer would ignore.

    Example:

    ```python
    >>> from layerwise_hf.integrations.axolotl import layerwise_settings
    >>> layerwise_settings({"optimizer": "adamw_8bit_layerwise", "layerwise_clip": "previous"})
    {'layerwise_clip': 'previous'}
    >>> layerwise_settings({"optimizer": "adamw_torch"}) is None
    True
    ```
    """
    optimizer = cfg.get("optimizer")
    if not isinstance(optimizer, str) or not optimizer.endswith("_layerwise"):
        if cfg.get("layerwise_clip") is not None:
            raise ValueError(
                f"layerwise_clip={cfg.get('layerwise_clip')!r} is set but optimizer={optimizer!r} is not a layer-wise "
                "name: set optimizer to '<base>_layerwise' (e.g. adamw_torch_layerwise) or remove layerwise_clip."
            )
        return None
    parse_optim_name(optimizer)  # an unknown name: ValueError listing the valid ones
    ignored = [f"{key} ({what})" for key, what in IGNORED_BY_LAYERWISE.items() if cfg.get(key) is not None]
    if ignored:
        raise ValueError(
            f"optimizer={optimizer!r} builds one optimizer per parameter, which does not read axolotl's "
            + ", ".join(ignored)
            + ": remove them, or use a standard optimizer name."
        )
    clip = cfg.get("layerwise_clip")
    return {"layerwise_clip": None if clip is None else ClipMode.parse(clip).value}


class LayerwisePlugin(BasePlugin):
    """
    axolotl plugin (`plugins: [layerwise_hf.integrations.axolotl.LayerwisePlugin]`): with `optimizer:
    <base>_layerwise` in the YAML, axolotl's trainer trains layer-wise, exactly as `LayerwiseTrainer` does. Any
    other optimizer: the plugin changes nothing.

    Example:

    ```yaml
    plugins:
      - layerwise_hf.integrations.axolotl.LayerwisePlugin
    optimizer: adamw_8bit_layerwise
    ```
    """

    def __init__(self):
        super().__init__()
        self.installed_here = False

    def get_input_args(self) -> str | None:
        return "layerwise_hf.integrations.axolotl.LayerwiseArgs" if BaseModel is not None else None

    def register(self, cfg):
        settings = layerwise_settings(cfg)
        if settings is None:
            logger.warning(
                "%s is listed in plugins but optimizer=%r is not a layer-wise name: it changes nothing.",
                PLUGIN,
                cfg.get("optimizer"),
            )
            return
        if not patching.is_installed():
            self.installed_here = True
        patching.install(**settings)

    def on_config_validation_error(self, cfg):
        self._uninstall()

    def post_trainer_create(self, cfg, trainer):
        from .trainer import LayerwiseTrainerMixin

        optim = getattr(trainer.args, "optim", None)
        if is_layerwise_name(getattr(optim, "value", optim)) and not isinstance(trainer, LayerwiseTrainerMixin):
            raise RuntimeError(
                f"{type(trainer).__name__} was created without the layer-wise mixin although optim={optim!r}: "
                f"{PLUGIN}.register() did not run before the trainer was built (is the plugin listed in `plugins:`?)."
            )
        from .callback import LayerwiseCallback

        # NOTE: axolotl's logging config passes INFO only from loggers named axolotl.* (AxolotlOrWarnErrorFilter), so
        # Trainer's INFO lines, and the run's account that goes with them, would not show.
        for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
            if isinstance(callback, LayerwiseCallback):
                callback.report_logger = logging.getLogger(REPORT_LOGGER)

    def post_train_unload(self, cfg):
        self._uninstall()

    def _uninstall(self):
        if self.installed_here:
            patching.uninstall()
            self.installed_here = False
