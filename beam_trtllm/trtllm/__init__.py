"""Beam on TensorRT-LLM's PyTorch backend, as an out-of-tree model package.

Importing this package never imports TensorRT-LLM: the pure parts (the HF -> TRT-LLM weight
mapping in `weight_mapper`, the LLM-API / engine-args YAML in `llm_args`, the Hugging Face config
class in `configuration_beam`) work anywhere. The model itself lives in `modeling_beam`, which
imports TensorRT-LLM and registers `BeamForCausalLM` with `register_auto_model` when it is
imported. Three ways to get it imported (docs/TRTLLM.md):

- LLM API: `import beam_trtllm.trtllm.modeling_beam`, then `LLM(model=ckpt)`;
- `trtllm-serve CKPT --custom_module_dirs CUSTOM_MODULE_DIR` (the folder below, whose package
  `__init__` is that one import);
- Dynamo: `python -m beam_trtllm.trtllm.dynamo_worker <dynamo.trtllm arguments>`.
"""

from pathlib import Path

from .errors import LlmArgsError, MissingPackageError, TrtllmAdapterError, WeightMappingError

# For `trtllm-serve --custom_module_dirs`: TRT-LLM imports the folder as a top-level package
# (`beam_model`), whose __init__ imports modeling_beam and so registers the model.
CUSTOM_MODULE_DIR = Path(__file__).resolve().parent / "beam_model"

__all__ = ["CUSTOM_MODULE_DIR", "LlmArgsError", "MissingPackageError", "TrtllmAdapterError",
           "WeightMappingError"]
