"""Host memory of `dpjax.hf`'s import (issue 41): a Llama of llama3-1b's width (4 layers, 506M parameters, bf16
safetensors) read onto a 1x8 mesh of simulated CPU devices, the process's anonymous memory (RssAnon, sampled
every 5 ms) against the float32 parameters and the largest device block.

    python experiments/hf_import_memory.py [--folder DIR] [--json]      # ~1 GB of safetensors written first
    python experiments/hf_import_memory.py --smoke                      # a tiny model, for the tests

On CPU the devices' buffers are host memory too, so the figure that matters is what the process holds beyond
them: `over_model` = (peak - before - float32 parameters) / largest block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

FULL = {"V": 128256, "D": 2048, "F": 8192, "H": 32, "Y": 8, "L": 4}
SMOKE = {"V": 1024, "D": 64, "F": 128, "H": 8, "Y": 8, "L": 2}


def anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def make_folder(folder: str, s: dict) -> None:
    """Random bf16 weights in the Hub's layout and names (tied embeddings, as llama3-1b)."""
    from dpjax.hf.files import write_folder

    V, D, F, H, Y, L = (s[k] for k in "VDFHYL")
    K = D // H
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * K, D), p + "self_attn.k_proj.weight": (Y * K, D),
                       p + "self_attn.v_proj.weight": (Y * K, D), p + "self_attn.o_proj.weight": (D, H * K),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    write_folder(folder, list(shapes), lambda n: (np.dtype(ml_dtypes.bfloat16), shapes[n]),
                 lambda n: (rng.standard_normal(shapes[n], np.float32) * 0.02).astype(ml_dtypes.bfloat16), 2**30)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": F,
                   "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": Y,
                   "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                   "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}, f)


def measure(folder: str) -> dict:
    import jax

    from dpjax import cpu_guards, make_mesh
    from dpjax.hf.load import load_params, model_from_hf
    from dpjax.sharding import make_layout

    cpu_guards()  # the 8 devices are XLA_FLAGS' (above): their collectives' guards, as dpjax.train has them
    model, _ = model_from_hf(folder)
    layout = make_layout(model, make_mesh("1x8", jax.devices()[:8]))
    jax.block_until_ready(jax.device_put(np.zeros(1), jax.devices()[0]))  # the client started before "before"
    samples, stop = [], []

    def watch():
        while not stop:
            samples.append(anon())
            time.sleep(0.005)

    before = anon()
    watcher = threading.Thread(target=watch)
    watcher.start()
    params = jax.block_until_ready(load_params(folder, model, layout))
    stop.append(True)
    watcher.join()
    after = anon()
    leaves = jax.tree.leaves(params)
    largest = max(s.data.nbytes for x in leaves for s in x.addressable_shards)
    model_bytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    peak = max(samples + [after])
    return {"params": model.num_params(params), "device_bytes": model_bytes, "largest_block": largest,
            "anon_before": before, "anon_after": after, "anon_peak": peak,
            "over_model": (peak - before - model_bytes) / largest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model in a temporary folder")
    p.add_argument("--folder", help="where the safetensors are (made there first if absent)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or os.path.join(tmp, "model")
        if not os.path.exists(os.path.join(folder, "config.json")):
            make_folder(folder, SMOKE if args.smoke else FULL)
        out = measure(folder)
    if args.json or args.smoke:
        print(json.dumps(out))
    else:
        print(f"{out['params']:,} parameters, {out['device_bytes'] / 2**30:.2f} GiB on the devices, largest block "
              f"{out['largest_block'] / 2**20:.0f} MiB; anonymous memory {out['anon_before'] / 2**30:.2f} -> peak "
              f"{out['anon_peak'] / 2**30:.2f} GiB: {out['over_model']:.2f} x the largest block beyond the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
