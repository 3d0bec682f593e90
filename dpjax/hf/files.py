"""The safetensors format, read memory-mapped and written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}) and the
tensors' raw little-endian bytes (https://github.com/huggingface/safetensors). A Hub
checkpoint is one `model.safetensors` or several shards named by
`model.safetensors.index.json`'s `weight_map`. dpjax reads the format itself, as numpy
memory maps (`np.memmap`): slicing one reads only those bytes from the page cache, so a
device's block of a weight is read without the whole weight ever being on the host, and
bfloat16 (which the `safetensors` package's numpy API lacks) reads as ml_dtypes' type.
The `safetensors` package (the `hf` extra) is the tests' independent reader.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from dpjax.errors import UserError

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFError(UserError):
    """A HuggingFace folder or file dpjax cannot use; the message says why."""


def read_header(path: str) -> tuple[dict, int]:
    """(header, byte offset of the data) of one safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFError(f"{path}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > os.path.getsize(path):
            raise HFError(f"{path}: not a safetensors file (header length {n} beyond the file)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:  # JSON or UTF-8: a cut or corrupt header
            raise HFError(f"{path}: not a safetensors file ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise HFError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, 8 + n


def _entry(path: str, key: str, info, start: int) -> tuple:
    """(dtype, shape, first byte) of one tensor, once its bytes are inside the file: a
    truncated or corrupt file is named here rather than failing in a memory map later."""
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(int(n) for n in info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise HFError(f"{path}: tensor {key}'s entry is not a safetensors one (a corrupt file)") from None
    if dtype not in DTYPES:
        raise HFError(f"{path}: tensor {key} has dtype {dtype}; dpjax reads {', '.join(DTYPES)}")
    size = os.path.getsize(path)
    if end - begin != int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize or begin < 0:
        raise HFError(f"{path}: tensor {key}'s bytes [{begin}, {end}) do not fit its shape {list(shape)} "
                      "(a corrupt file)")
    if start + end > size:
        raise HFError(f"{path}: cut short ({size} bytes, tensor {key} ends at byte {start + end}); "
                      "download or copy it again")
    return DTYPES[dtype], shape, start + begin


class Tensors:
    """Every tensor of a HuggingFace folder by name, each a read-only memory map."""

    def __init__(self, folder: str):
        self.folder = folder
        index, single = os.path.join(folder, INDEX), os.path.join(folder, SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(single):
            files = [SINGLE]
        else:
            raise HFError(f"{folder}: no {SINGLE} or {INDEX} (a HuggingFace model folder has one)")
        self.where = {}  # name -> (path, dtype, shape, begin byte)
        for name in files:
            path = os.path.join(folder, name)
            header, start = read_header(path)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                self.where[key] = (path, *_entry(path, key, info, start))
        self._maps = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self):
        return list(self.where)

    def dtype(self, name: str) -> np.dtype:
        return self.where[name][1]

    def shape(self, name: str) -> tuple:
        return self.where[name][2]

    def __getitem__(self, name: str) -> np.ndarray:
        """The tensor as a memory map: nothing is read until it is sliced."""
        if name not in self.where:
            raise HFError(f"{self.folder}: no tensor {name}")
        if name not in self._maps:
            path, dtype, shape, begin = self.where[name]
            self._maps[name] = np.memmap(path, dtype=dtype, mode="r", offset=begin, shape=shape)
        return self._maps[name]


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most `max_bytes` each (a tensor larger than
    that has a file of its own), in order, as transformers' save_pretrained does."""
    shards, size = [[]], 0
    for name, n in sizes:
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_file(path: str, names: list[str], spec, fetch, metadata: dict | None = None) -> None:
    """One safetensors file holding `names`; spec(name) -> (dtype, shape), fetch(name) ->
    the numpy array, called one tensor at a time as it is written (only one is ever held)."""
    header, offset = {}, 0
    for name in names:
        dtype, shape = spec(name)
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in names:
            dtype, shape = spec(name)
            array = np.ascontiguousarray(fetch(name), dtype=dtype)
            assert array.shape == tuple(shape), (name, array.shape, shape)
            f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())


def write_folder(folder: str, names: list[str], spec, fetch, max_shard_bytes: int) -> list[str]:
    """`names` into `folder` as the Hub lays a checkpoint out: one model.safetensors, or
    model-0000i-of-0000n.safetensors and their index when they exceed `max_shard_bytes`.
    Returns the files written."""
    sizes = [(n, int(np.prod(spec(n)[1], dtype=np.int64)) * np.dtype(spec(n)[0]).itemsize) for n in names]
    shards = plan_shards(sizes, max_shard_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        write_file(os.path.join(folder, SINGLE), shards[0], spec, fetch, meta)
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        write_file(os.path.join(folder, file), shard, spec, fetch, meta)
    index = {"metadata": {"total_size": sum(n for _, n in sizes)},
             "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return [*files, INDEX]
