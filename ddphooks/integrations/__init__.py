"""Drop-in integrations of ddphooks with training frameworks.

Each integration lives in its own submodule (``transformers``, ``lightning`` ...) and imports its
framework only when that submodule is imported, so ``import ddphooks`` (and ``import
ddphooks.integrations``) stays light. For example:

- ``ddphooks.integrations.transformers.SilentCallback``: a ``transformers.TrainerCallback`` for
  ``Trainer`` and its subclasses (TRL's ``SFTTrainer`` ...).
- Accelerate needs no adapter: ``ddphooks.attach(model)`` on what ``accelerator.prepare`` returns.

Example::
    >>> import ddphooks
    >>> callback = ddphooks.integrations.transformers.SilentCallback(sketch_dim=256)
"""

import importlib
import importlib.util


def __getattr__(name: str):
    # `ddphooks.integrations.<framework>` after a plain `import ddphooks`: the submodule (and its
    # framework) is imported on first access only.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
