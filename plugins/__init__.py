"""Beam's custom kernels as `torch.ops.beam.*` ops. Importing this package registers every op
file in it (one op per file), so callers only `import plugins` and use `torch.ops.beam.<op>`."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("registry",) and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
