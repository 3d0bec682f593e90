"""HuggingFace checkpoints in and out of dpjax's models, one family (architecture) an entry.

    family.py   the registry: one `Family` a Hub architecture (its config keys, its weight map, its dpjax model)
    llama.py    the Llama's entry (LlamaForCausalLM), whose tables the others extend
    mixtral.py  Mixtral's (a mixture of SwiGLU experts, one Hub tensor an expert)
    qwen.py     Qwen2's (q/k/v biases; Qwen2.5) and Qwen3's (per-head q/k norms, explicit head_dim)
    layouts.py  each dpjax leaf's place in its Hub tensors (transposes and reshapes)
    files.py    the safetensors format: memory-mapped reads, one-tensor-at-a-time writes, shards + index
    config.py   config.json's keys in both transformers layouts (4.x top-level rope keys, 5.x rope_parameters)
    load.py     a Hub folder -> the model and its parameters, each device's block read for its device
    writer.py   parameters -> a Hub folder (`export`); the dpjax checkpoint an import writes
    source.py   `hf:DIR` or a dpjax checkpoint -> model and parameters (--init-from, generate, export)

`python -m dpjax.hf import DIR --out CKPT` and `python -m dpjax.hf export CKPT --out DIR`.
"""

from dpjax.hf import gemma, llama, mistral, mixtral, qwen  # noqa: F401  (each family's module registers it)
from dpjax.hf.writer import export, save_checkpoint
from dpjax.hf.files import HFError, Tensors
from dpjax.hf.load import load_params, model_from_hf
from dpjax.hf.source import is_hf, model_of, params_of

__all__ = ["HFError", "Tensors", "export", "is_hf", "load_params", "model_from_hf", "model_of", "params_of",
           "save_checkpoint"]
