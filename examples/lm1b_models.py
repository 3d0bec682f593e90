"""flax's lm1b language model (examples/lm1b/models.py in google/flax), its training path
written again for dpjax's tests: a decoder-only Transformer in Linen, every parameter
annotated with flax's logical axis names as lm1b annotates it (`nn.with_logical_partitioning`:
'vocab', 'embed', 'mlp', and ('embed', 'kv') on the attention's kernels), the same modules,
names, initialisers, masks, dropouts and sinusoidal positions. The autoregressive cache
(`decode=True`), which training never uses, is left out.
"""

from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax import lax


@struct.dataclass
class TransformerConfig:
  vocab_size: int
  output_vocab_size: int
  share_embeddings: bool = False
  logits_via_embedding: bool = False
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 2048
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False
  decode: bool = False
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)
  posemb_init: Optional[Callable] = None


def shift_right(x, axis=1):
  """x shifted right by one along axis, a 0 coming in."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (1, 0)
  padded = jnp.pad(x, widths, mode='constant', constant_values=x.dtype.type(0))
  return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def shift_inputs(x, segment_ids=None, axis=1):
  """Inputs shifted right; with packed segments, a segment's first input is 0."""
  shifted = shift_right(x, axis=axis)
  if segment_ids is not None:
    shifted *= segment_ids == shift_right(segment_ids, axis=axis)
  return shifted


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
  """The fixed sine / cosine position table, (1, max_len, features)."""

  def init(key, shape, dtype=np.float32):
    del key, dtype
    features = shape[-1]
    table = np.zeros((max_len, features), dtype=np.float32)
    position = np.arange(0, max_len)[:, np.newaxis]
    scale_factor = -np.log(max_scale / min_scale) / (features // 2 - 1)
    div_term = min_scale * np.exp(np.arange(0, features // 2) * scale_factor)
    table[:, : features // 2] = np.sin(position * div_term)
    table[:, features // 2 : 2 * (features // 2)] = np.cos(position * div_term)
    return jnp.array(table[np.newaxis, :, :])

  return init


class AddPositionEmbs(nn.Module):
  config: TransformerConfig
  decode: bool = False

  @nn.compact
  def __call__(self, inputs, inputs_positions=None):
    config = self.config
    assert inputs.ndim == 3
    shape = (1, config.max_len, inputs.shape[-1])
    if config.posemb_init is None:
      table = sinusoidal_init(max_len=config.max_len)(None, shape, None)
    else:
      table = self.param('pos_embedding', config.posemb_init, shape)
    pe = table[:, : inputs.shape[1], :]
    if inputs_positions is None:
      return inputs + pe
    return inputs + jnp.take(pe[0], inputs_positions, axis=0)


class MlpBlock(nn.Module):
  config: TransformerConfig
  out_dim: Optional[int] = None

  @nn.compact
  def __call__(self, inputs):
    config = self.config
    out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
    x = nn.Dense(config.mlp_dim, dtype=config.dtype,
                 kernel_init=nn.with_logical_partitioning(config.kernel_init, ('embed', 'mlp')),
                 bias_init=nn.with_logical_partitioning(config.bias_init, ('mlp',)))(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    out = nn.Dense(out_dim, dtype=config.dtype,
                   kernel_init=nn.with_logical_partitioning(config.kernel_init, ('mlp', 'embed')),
                   bias_init=nn.with_logical_partitioning(config.bias_init, ('embed',)))(x)
    return nn.Dropout(rate=config.dropout_rate)(out, deterministic=config.deterministic)


def _layer_norm(config, name=None):
  return nn.LayerNorm(dtype=config.dtype, name=name,
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('embed',)))


class EncoderDecoder1DBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None, encoder_decoder_mask=None):
    config = self.config
    assert inputs.ndim == 3
    x = _layer_norm(config)(inputs)
    x = nn.SelfAttention(num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
                         kernel_init=nn.with_logical_partitioning(config.kernel_init, ('embed', 'kv')),
                         bias_init=nn.with_logical_partitioning(config.bias_init, ('embed',)),
                         use_bias=False, broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
                         deterministic=config.deterministic, decode=config.decode)(x, decoder_mask)
    x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
    x = x + inputs
    z = _layer_norm(config)(x)
    z = MlpBlock(config=config)(z)
    return x + z


class Decoder(nn.Module):
  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None, decoder_mask=None,
               encoder_decoder_mask=None):
    config = self.config
    assert inputs.ndim == 2
    if self.shared_embedding is None:
      embed = nn.Embed(num_embeddings=config.output_vocab_size, features=config.emb_dim,
                       embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0),
                                                                   ('vocab', 'embed')))
    else:
      embed = self.shared_embedding
    y = inputs.astype('int32')
    if not config.decode:
      y = shift_inputs(y, segment_ids=inputs_segmentation)
    y = embed(y)
    y = AddPositionEmbs(config=config, decode=config.decode, name='posembed_output')(
        y, inputs_positions=inputs_positions)
    y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
    y = y.astype(config.dtype)
    for layer in range(config.num_layers):
      y = EncoderDecoder1DBlock(config=config, name=f'encoderdecoderblock_{layer}')(
          y, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask)
    y = _layer_norm(config, name='encoderdecoder_norm')(y)
    if config.logits_via_embedding:
      return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
    return nn.Dense(config.output_vocab_size, dtype=config.dtype,
                    kernel_init=nn.with_logical_partitioning(config.kernel_init, ('embed', 'vocab')),
                    bias_init=nn.with_logical_partitioning(config.bias_init, ('vocab',)), name='logitdense')(y)


class TransformerLM(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
    config = self.config
    decoder_mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
                                    nn.make_causal_mask(inputs, dtype=config.dtype))
    if inputs_segmentation is not None:
      decoder_mask = nn.combine_masks(decoder_mask, nn.make_attention_mask(
          inputs_segmentation, inputs_segmentation, jnp.equal, dtype=config.dtype))
    logits = Decoder(config=config, shared_embedding=None, name='decoder')(
        inputs, inputs_positions=inputs_positions, inputs_segmentation=inputs_segmentation,
        decoder_mask=decoder_mask, encoder_decoder_mask=None)
    return logits.astype(self.config.dtype)
