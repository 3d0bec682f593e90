"""Supervised fine-tuning: next-token cross-entropy counted on the answer tokens only.

The batch is {"tokens": B x T+1 int32, "weights": B x T float32}: `weights[b, t]` is how
much the target tokens[b, t+1] counts. The data makes them (`dpjax.data.sft`): an answer
token's weight is N / n, with n the answer tokens of the whole step (every micro-batch,
every device) and N its token slots (A x B x T), every other target's 0. Each device's
loss is then the plain mean over its own slots of weight x cross-entropy, and the step's
usual averages (over the micro-batches, over the data axes' devices, over a context
axis's shares of each sequence) make it sum(answer cross-entropy) / n: the mean over the
answer tokens of the whole global batch (TRL's and HuggingFace's convention), the same on
every mesh and with or without packing, with no count exchanged inside the step.

Packed rows (`--pack`, `dpjax.data.sft.PackedStream`) add "segment_ids" and "positions",
B x T int32 each (the inputs': which example each token is of, 0 for padding, and its
position within it); they are split like the tokens over a context axis and given to the
model as `dpjax.compute.attention.Segments`, so that attention stays within an example and
positions restart at each. The weights already leave out a target of another example.
"""

from __future__ import annotations

from dpjax.compute import context
from dpjax.compute.attention import Segments
from dpjax.compute import tensor_parallel as tp
from dpjax.compute.tensor_parallel import DENSE, Parallel


def loss_and_stats(model):
    """(loss, the model's statistics or None) of the weighted next-token cross-entropy."""

    def fn(params, batch, par: Parallel = DENSE):
        tokens_BdxT1, weights_BdxT = batch["tokens"], batch["weights"]
        assert weights_BdxT.shape == (tokens_BdxT1.shape[0], tokens_BdxT1.shape[1] - 1), (
            weights_BdxT.shape, tokens_BdxT1.shape)
        inputs_BdxTc = context.split(tokens_BdxT1[:, :-1], par)
        targets_BdxTc, weights_BdxTc = context.split(tokens_BdxT1[:, 1:], par), context.split(weights_BdxT, par)
        segments = None
        if "segment_ids" in batch:  # packed rows (the batch's keys are fixed when the step is traced)
            segments = Segments(context.split(batch["segment_ids"], par), context.split(batch["positions"], par))
        logits_BdxTcxVm, aux = model.forward(params, inputs_BdxTc, par, segments)
        assert aux is None, "dpjax.plan refuses --task sft with experts (the router's losses are not weighted yet)"
        return tp.vocab_parallel_cross_entropy(logits_BdxTcxVm, targets_BdxTc, par, weights_BdxT=weights_BdxTc), None

    return fn


def loss(model):
    sft = loss_and_stats(model)
    return lambda params, batch, par=DENSE: sft(params, batch, par)[0]
