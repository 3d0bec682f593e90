"""Pretraining: the mean next-token cross-entropy over every token of the batch (the
model's own `loss`; its `loss_and_stats` for a mixture's router figures)."""

from __future__ import annotations


def loss(model):
    return model.loss


def loss_and_stats(model):
    return model.loss_and_stats
