"""`trtllm-serve CKPT --custom_module_dirs <this folder>`: TRT-LLM imports this folder as the
package `beam_model`; importing the model module registers BeamForCausalLM (and its weight
mapper) with TRT-LLM's registries. Needs TensorRT-LLM; see docs/TRTLLM.md."""

import beam_trtllm.trtllm.modeling_beam  # noqa: F401  (registers on import)
