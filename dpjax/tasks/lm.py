"""Pretraining: the mean next-token cross-entropy over every token of the batch (the
model's own `loss`; its `loss_and_stats` for a mixture's router figures)."""

from __future__ import annotations


def loss(model, settings=None):
    return model.loss


def loss_and_stats(model, settings=None):
    return model.loss_and_stats
