"""A synthetic image data set for the flax examples: 16 x 16 grey images of four shapes.

Class 0 is a horizontal bar, 1 a vertical bar, 2 a diagonal, 3 a filled square, each at
a random place, on Gaussian noise. Generated from a seed (no download), it plays the
part MNIST plays in flax's own examples: batches are dicts of NumPy arrays,
`{"image": B x 16 x 16 x 1 float32, "label": B int32}`, as tensorflow_datasets gives them.
"""

import numpy as np

SIZE, CLASSES = 16, 4


def make(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, CLASSES, n).astype(np.int32)
    image = 0.5 * rng.standard_normal((n, SIZE, SIZE)).astype(np.float32)
    r, c = rng.integers(2, SIZE - 6, (2, n))
    span = np.arange(2, SIZE - 2)
    for i in range(n):
        if label[i] == 0:
            image[i, r[i], span] += 1.0
        elif label[i] == 1:
            image[i, span, c[i]] += 1.0
        elif label[i] == 2:
            image[i, span, span[::-1] if r[i] % 2 else span] += 1.0
        else:
            image[i, r[i]:r[i] + 4, c[i]:c[i] + 4] += 1.0
    return {"image": image[..., None], "label": label}


def train_batches(steps: int, batch_size: int = 64, seed: int = 0):
    """`steps` batches of fresh examples."""
    for s in range(steps):
        yield make(batch_size, seed * 1000 + s)


def test_batches(batches: int = 2, batch_size: int = 128, seed: int = 0):
    """A fixed test set, different from every training batch."""
    for s in range(batches):
        yield make(batch_size, 10**6 + seed * 1000 + s)
