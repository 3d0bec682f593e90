"""The names a TRL or HuggingFace Trainer user types (`--learning_rate`, `num_train_epochs:` in a YAML file),
and the dpjax flag that says the same thing: an unknown flag or --config key that is one of them is answered
with dpjax's name in the one-line error, where spelling distance ("did you mean") finds nothing."""

from __future__ import annotations

# TRL's (SFTConfig, DPOConfig, GRPOConfig) and transformers' TrainingArguments' names -> dpjax's flag, with
# what differs where it does
TRL_NAMES = {
    "learning_rate": "--lr",
    "num_train_epochs": "--steps (dpjax counts optimizer steps; the data line says the epochs they read)",
    "max_steps": "--steps",
    "per_device_train_batch_size": "--batch-size (the global batch, split over the data axes)",
    "gradient_accumulation_steps": "--backward-passes",
    "max_seq_length": "--seq-len",
    "max_length": "--seq-len",
    "warmup_ratio": "--warmup-steps (a count of steps)",
    "lr_scheduler_type": "--lr-schedule",
    "max_grad_norm": "--clip-norm",
    "output_dir": "--ckpt-dir",
    "save_steps": "--ckpt-every",
    "eval_steps": "--eval-every",
    "resume_from_checkpoint": "--resume",
    "model_name_or_path": "--init-from hf:DIR",
    "packing": "--pack first_fit",
    "assistant_only_loss": "--loss-on assistant (the default)",
    "completion_only_loss": "--loss-on completion",
    "beta": "--dpo-beta (DPO) or --kl-coef (GRPO)",
    "loss_type": "--dpo-loss",
    "num_generations": "--group-size",
    "max_completion_length": "--max-completion",
    "lora_r": "--lora r=R",
    "lora_alpha": "--lora alpha=A",
    "lora_dropout": "--lora dropout=0.0",
    "target_modules": "--lora targets=q,k,v,o,gate,up,down",
}


def dpjax_name(word: str) -> str | None:
    """'; TRL's learning_rate is --lr here' for a flag or key spelled as TRL spells it, else None."""
    name = word.lstrip("-").split("=")[0].replace("-", "_")
    flag = TRL_NAMES.get(name)
    return f"; TRL's {name} is {flag} here" if flag else None
