"""The settings of a run: one typed dataclass, from which `python -m dpjax.train`'s
command line, `--help` and the run record are generated (levanter's typed configs).

What the fields mean is here; whether a combination makes sense, and what it resolves
to on a given set of devices, is `dpjax.plan`'s business, and only its.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The registries whose names the flags offer, read when --help or a check asks (a lambda
# each, below): a model or task registered after this import still shows.
from dpjax import collectives, compression, distributed, models, optim, pipeline, tasks, updates
from dpjax.compute import context
from dpjax.data import packing
from dpjax.tasks import dpo


def _chat():
    # Imported when read, not with dpjax: `python -m dpjax.data.chat` runs that module as __main__, and
    # runpy warns (a RuntimeWarning on every run) when `import dpjax` has already imported it.
    from dpjax.data import chat
    return chat


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


def _topic(title: str):
    """The field maker of one topic: `--help` groups the flags by it (argparse argument
    groups), so a flag is found beside the ones it works with, not in a list of 60."""

    def make(default, help, **kw):
        return _opt(default, help, topic=title, **kw)

    return make


# The topics of --help, in the order it shows them, and the field maker of each.
TOPICS = ("mesh and parallelism", "model and data", "optimizer and steps", "compute policy and memory",
          "gradient exchange", "metrics, evaluation and progress", "checkpoints, resuming and failures",
          "timeline and autotune")
MESH, MODEL, OPTIM, COMPUTE, EXCHANGE, OUTPUT, SAVE, TIMELINE = map(_topic, TOPICS)
DEFAULT_LR = 3e-3  # a rate for training from scratch (a fine-tune at it is told so: dpjax.plan.task.rate_notes)


@dataclass
class Settings:
    """Every setting of a run, as the user gave it (nothing here is checked: that is
    `dpjax.plan.resolve`'s job). The command line is generated from these fields (a field
    `batch_size` is the flag `--batch-size`; `choices` and `help` may be callables that read
    a registry when the parser is built; `topic` is its group in --help); model options (`--d-model`, ...) come from the
    models' own configs into `model_options`."""

    mesh: str | None = MESH(None, "device mesh: '8' or '8x1' (data x model), '2x2x2' (node x data x model), "
                                  "'data=2,model=4'; one -1 takes the remaining devices. Default: every device "
                                  "on data")
    model: str = MODEL("gpt", lambda: f"the model: {', '.join(models.MODELS)}")
    preset: str | None = MODEL(None, lambda: f"a named model shape: {', '.join(models.presets())} (sets --model "
                                            "and its options, and --vocab-size unless given; options given override "
                                            "it)")
    data: str = MODEL("stdlib", "'stdlib' (the Python standard library's source), a text file, a folder of text "
                               "files, 'synthetic' (random tokens), a file of token ids ending in .bin (uint16 "
                               "or uint32, as nanoGPT and llm.c write them; needs --vocab-size), or chat:PATH "
                               "(conversations, FILE.jsonl or a folder of them: fine-tuning on the answers, "
                               "--task sft; docs/finetune.md)")
    tokenizer: str | None = MODEL(None, "tokenize the text --data with this: a HuggingFace tokenizer.json or a "
                                        "SentencePiece .model (both need the hf extra), or bpe:N (a byte-level BPE "
                                        "of N ids trained on the corpus first). Default: bytes (256 ids)")
    task: str | None = MODEL(None, lambda: "what the step optimises: " + "; ".join(
        f"{t.name}: {t.about}" for t in tasks.TASKS.values())
        + ". Default: sft for --data chat:PATH, grpo with --prompts, else lm",
                             choices=lambda: tuple(tasks.TASKS))
    # Chat data (--data chat:PATH; dpjax.data.chat)
    loss_on: str = MODEL("assistant", "with chat data, which tokens the loss counts: assistant (each assistant "
                                      "turn's answer and its end-of-turn token), completion (what follows the "
                                      "prompt of prompt/completion rows), all (every token)",
                         choices=lambda: _chat().LOSS_ON)
    truncate: str = MODEL("right", "with chat data, a conversation longer than --seq-len + 1 tokens: right (keep "
                                   "its start), left (keep its end) or drop it; counted in the run record",
                          choices=lambda: _chat().TRUNCATE)
    no_answer: str = MODEL("skip", "with chat data, a row without an answer to train on: skip it (counted) or "
                                   "refuse the data (one line naming the row)", choices=lambda: _chat().NO_ANSWER)
    pack: str = MODEL("none", "with chat data, several conversations in one row of --seq-len + 1 tokens, each "
                              "attending only to itself with its own positions: first_fit or best_fit (decreasing), "
                              "or none (one a row). --batch-size still counts conversations",
                      choices=lambda: tuple(packing.METHODS))
    pack_window: int | None = MODEL(None, "with chat data, deal the conversations of this many consecutive steps "
                                          "among them so that each step holds nearly the same tokens (still "
                                          "--batch-size conversations each): the packed rows a step needs are the "
                                          "mean's, not the heaviest step's. Default: an epoch's steps with --pack, 1 "
                                          "(the seeded order as it is) without; give the same value to an unpacked "
                                          "run to read the same conversations each step")
    chat_template: str | None = MODEL(None, "with chat data, a jinja chat template file to render the rows with "
                                            "instead of the model's own (its tokenizer folder's chat_template.jinja "
                                            "or tokenizer_config.json's chat_template)")
    eval_data: str | None = MODEL(None, "with chat data or preference pairs, held-out data like --data: chat:PATH "
                                        "(the eval loss on answers) or pref:PATH (the eval loss and accuracy on "
                                        "pairs). Default: --eval-fraction of --data held out")
    eval_fraction: float | None = MODEL(None, "with chat data or pairs, the fraction of its rows held out (seeded "
                                              "by --seed) for the eval loss on answers. Default: 0.05 (at least "
                                              "one), unless --eval-data is given")
    # Preference pairs (--data pref:PATH, --task dpo; dpjax.tasks.dpo, docs/preferences.md)
    dpo_loss: str = MODEL("sigmoid", lambda: "with preference pairs, the loss: " + "; ".join(
        f"{v.name}: {v.about}" for v in dpo.VARIANTS.values()), choices=lambda: tuple(dpo.VARIANTS))
    dpo_beta: float = MODEL(0.1, "with preference pairs, beta: how far the policy may move from the reference "
                                 "(SimPO: the reward's scale, about 2)")
    simpo_gamma: float = MODEL(0.5, "with --dpo-loss simpo, the target reward margin gamma")
    ref_logps: str = MODEL("precompute", "with preference pairs, the reference's log-probs: precompute (every "
                                         "pair's, once before training, with the starting weights or --ref-from's: "
                                         "no second copy of the model); online (in each step: with --lora the base "
                                         "with the adapters off, no copy; else a frozen copy split like the "
                                         "policy)", choices=("precompute", "online"))
    ref_from: str | None = MODEL(None, "with preference pairs, the reference model: hf:DIR or a checkpoint folder "
                                       "of the same shape. Default: the starting weights (--init-from's)")
    # Rewards (--task grpo; dpjax.tasks.grpo, dpjax.train.rollout, docs/preferences.md)
    prompts: str | None = MODEL(None, "with --task grpo, the prompts: FILE.jsonl (or a folder of them) of "
                                      "{\"prompt\": text or messages} rows (messages: the chat template applies)")
    reward: str | None = MODEL(None, "with --task grpo, the reward: module:function or path/to/file.py:function, "
                                     "called as function(prompt, completion[, row]) -> float")
    group_size: int = MODEL(8, "with --task grpo, completions sampled per prompt (at least 2: each completion's "
                               "advantage is its reward against its group's); --batch-size counts completions")
    max_completion: int = MODEL(32, "with --task grpo, new tokens a completion has at most (the prompt and these "
                                    "fit --seq-len)")
    temperature: float = MODEL(1.0, "with --task grpo, the sampling temperature of the completions")
    kl_coef: float = MODEL(0.04, "with --task grpo, the weight of the KL term to the reference (the starting "
                                 "weights); 0: no reference")
    clip_eps: float = MODEL(0.2, "with --task grpo, the clip range of the probability ratio (PPO's epsilon)")
    grpo_updates: int = MODEL(1, "with --task grpo, optimizer steps on each generation batch (each --steps step is "
                                 "one; the completions are sampled and scored once every this many)")
    vocab_size: int | None = MODEL(None, "the vocabulary of a token file (--data FILE.bin); default 256 (bytes)")
    token_dtype: str = MODEL("auto", "the ids' type in a token file; auto: uint32 if the file name says u32 or "
                                    "uint32, else uint16", choices=("auto", "uint16", "uint32"))
    steps: int = OPTIM(200, "optimizer steps to run (in total, counting resumed ones)")
    batch_size: int = OPTIM(32, "global batch in sequences (with chat data: conversations, one a row) per "
                                     "backward pass, split over the data axes")
    seq_len: int = MODEL(128, "tokens (bytes) per sequence")
    optimizer: str = OPTIM("adamw", lambda: f"the inner optimizer: {', '.join(optim.OPTIMIZERS)} (momentum: Nesterov, "
                                           "0.9)")
    lr: float = OPTIM(DEFAULT_LR, "learning rate (before any scaling)")
    lr_scaling: str = OPTIM("none", "linear: lr * global batch / 256 (Goyal et al. 2017)", choices=("none", "linear"))
    warmup_steps: int = OPTIM(0, "steps of linear learning-rate warmup (from 0; with --lr-scaling linear from --lr "
                                 "to the scaled rate, Goyal et al.'s gradual warmup)")
    lr_schedule: str = OPTIM("constant", lambda: "the learning rate after --warmup-steps: "
                             f"{optim.describe_schedules()}. Default: constant",
                             choices=lambda: tuple(optim.LR_SCHEDULES))
    min_lr: float = OPTIM(0.0, "the rate a decaying --lr-schedule ends at (as given: not scaled by --lr-scaling)")
    decay_steps: int | None = OPTIM(None, "steps of a decaying --lr-schedule's decay. Default: every step after "
                                          "warm-up, or the last fifth of --steps for one that decays at the end "
                                          "(wsd)")
    weight_decay: float = OPTIM(0.0, "AdamW's decoupled weight decay")
    clip_norm: float = OPTIM(1.0, "clip each worker's gradient to this global norm (0: off)")
    # The compute policy (dpjax.compute.policy) and what the planner may choose
    dtype: str = COMPUTE("auto", "compute dtype of the layers (matmuls, activations, a pipeline's sends); auto: "
                              "bfloat16 on GPU and TPU, float32 on CPU. Layer-norm statistics, softmax, logits, the "
                              "loss, gradient accumulation and the optimizer stay float32 whatever this says. fp8: "
                              "the layers' projection matmuls (attention's QKV and output, the MLP's, the experts') "
                              "in float8 with per-tensor current scaling (e4m3 operands forward, e5m2 gradients "
                              "backward, float32 accumulation), bfloat16 for the rest; NVIDIA GPUs of compute "
                              "capability 8.9+ (CPU emulates it)",
                      choices=("auto", "float32", "bfloat16", "float16", "fp8"))
    param_dtype: str = COMPUTE("float32", "dtype of the master weights and so of the optimizer state",
                            choices=("float32", "bfloat16", "float16"))
    remat: str = COMPUTE("auto", "what each layer keeps for the backward pass: none (everything: fastest), dots (the "
                              "matmul and attention outputs; the rest recomputed), full (only the layer's input; the "
                              "layer recomputed); auto: the least recomputation whose memory estimate fits a device",
                      choices=("auto", "none", "dots", "full"))
    attention: str = COMPUTE("auto", "causal attention kernel: naive (the T x T scores written out), xla "
                                  "(jax.nn.dot_product_attention's XLA kernel), cudnn (cuDNN flash attention: an "
                                  "NVIDIA GPU, bfloat16/float16, head width a multiple of 8 up to 256); auto: cudnn "
                                  "where it can run, else xla on a GPU, naive on CPU",
                          choices=("auto", "naive", "xla", "cudnn"))
    layer_loop: bool = COMPUTE(False, "run the stacked layers as a Python loop instead of one lax.scan (compile time "
                                   "then grows with depth; for comparison)")
    dry_run: bool = COMPUTE(False, "resolve the plan, print it (mesh, layout, dtype, remat, attention, memory per "
                                "device by part) and exit without compiling: 0 if it fits, 2 with one line if not")
    device_memory: str | None = COMPUTE(None, "plan for devices with this much memory, e.g. 80GiB, 141GB or 24000MB. "
                                           "With --dry-run on a machine without a GPU the plan is made for GPUs "
                                           "(bf16, cuDNN attention where eligible): plan a GPU job from a laptop. "
                                           "Default: what a device here has")
    update: str = MESH("sync", lambda: updates.HELP)
    workers: str | None = MESH(None, "the data axes the update rule's workers span, e.g. 'node' (one worker per "
                                     "node: synchronous data parallelism inside it, the rule between nodes). "
                                     "Default: every data axis for delayed/sparse/async (each rank a worker), "
                                     "none for sync. With --fsdp the parameters are split over the other data "
                                     "axes: '--workers node --fsdp' with sync is hybrid sharding (HSDP)")
    link: list[str] | None = EXCHANGE(None, "emulate a slow link on a mesh axis, e.g. 'node=183ms,23mbit' "
                                             "(repeatable): every collective crossing that axis waits for its "
                                             "alpha-beta time; values are unchanged, only time", action="append")
    allreduce: str | None = EXCHANGE(None, lambda: "gradient allreduce algorithm: "
                                               f"{', '.join(collectives.ALGORITHMS)}; or auto: each is timed on "
                                               "the first steps of the run and the fastest kept "
                                               "(recorded in the metrics and the checkpoint; a resumed run keeps "
                                               "it). Default: psum (XLA's own: NCCL) on GPU and TPU, ring on CPU")
    tp_allreduce: str = EXCHANGE("ring", lambda: "allreduce over the model axis inside tensor-parallel layers: "
                                           f"{', '.join(a for a in collectives.ALGORITHMS if a != 'hierarchical')}")
    fsdp: bool = MESH(False, "fully sharded data parallelism (ZeRO-3) inside each worker: parameters and "
                             "optimizer state split over the data axes too, all-gathered just before use, "
                             "gradients reduce-scattered (with the --allreduce algorithm)")
    fusion_mb: float | str = EXCHANGE(64.0, "tensor-fusion bucket cap in MiB (0: one allreduce per tensor); 'auto': "
                                        "timed on the first steps like --allreduce auto", type="mib")
    compression: str = EXCHANGE("none", lambda: "how gradients (and the rule's exchanges) travel on the wire: none, "
                                            f"{', '.join(compression.names())}; name[:N][,ef=0][,start=S], e.g. "
                                            "powersgd:4,start=100 (N: PowerSGD's rank, top-k's / random-k's "
                                            "fraction; ef=0: no error feedback; start: exact exchanges first). "
                                            "A method with error feedback compresses the exchange between workers "
                                            "(default: every data rank a worker). --optimizer onebit_adam without "
                                            "one runs onebit,start=S,refresh=2, S a fifth of --steps (at most 100)")
    compress_axes: str | None = EXCHANGE(None, "compress only the exchange crossing these data axes, e.g. 'node' (the "
                                           "slow link between sites); the workers are then these axes and the "
                                           "exchange inside a worker is exact")
    compress_whole: bool = EXCHANGE(False, "with --compress-axes: every device of a worker compresses and sends the "
                                       "whole gradient across (the earlier form). Default: the per-shard form, each "
                                       "device of a site sends only its 1/k shard across and the site all-gathers "
                                       "the k shards exactly")
    context_attention: str = MESH("ring", "with a context axis (--mesh data=2,context=4: each sequence split over "
                                          "it, device i holding chunks i and 2C-1-i of 2C): ring (K/V blocks passed "
                                          "round the axis, blockwise softmax) or allgather (K/V gathered, attended "
                                          "locally)", choices=lambda: tuple(context.CONTEXT_ATTENTIONS))
    expert_alltoall: str = MESH("pairwise", lambda: "with an expert axis (--mesh data=2,expert=4 --experts 8): the "
                                                  "all-to-all a mixture of experts dispatches tokens to their experts' "
                                                  "devices and combines them back by: "
                                                  f"{', '.join(collectives.ALL_TO_ALL_ALGORITHMS)} "
                                                  "(xla: lax.all_to_all, the baseline)",
                                choices=lambda: tuple(collectives.ALL_TO_ALL_ALGORITHMS))
    backward_passes: int = MESH(1, "micro-batches per step: gradients accumulated over this many backward "
                                   "passes, exchanged once")
    microbatches: int | None = MESH(None, "with a stage axis: micro-batches each data-parallel replica's batch is "
                                          "cut into, to flow through the pipeline's stages. Default: one per stage")
    schedule: str | None = MESH(None, "with a stage axis: the pipeline schedule (naive: one stage at a time; "
                                      "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward, "
                                      "memory bounded by the stages; interleaved: 1f1b over --virtual-stages "
                                      "chunks per stage). Default: 1f1b",
                                choices=lambda: tuple(pipeline.SCHEDULES))
    virtual_stages: int | None = MESH(None, "with --schedule interleaved: chunks of layers per stage, visited "
                                            "round robin (bubble (S-1)/(V*M+S-1)). Default: 2")
    seed: int = MODEL(0, "seed for initialisation, data order and async's staleness")
    eval_every: int = OUTPUT(50, "steps between validation evaluations (0: only at the end)")
    eval_batches: int = OUTPUT(4, "validation batches per evaluation")
    sample_tokens: int = OUTPUT(32, "at the end, print the model's greedy continuation of a validation sequence's "
                                    "start, this many tokens (0: none; not with --progress none)")
    metrics: str | None = OUTPUT(None, "write one JSON object per step to this file (JSON lines). An existing file "
                                       "is appended to by --resume (and an agent's restart) and refused otherwise")
    overwrite: bool = OUTPUT(False, "replace an existing --metrics file, and another run's checkpoints in --ckpt-dir "
                                    "and commits in --commit-dir, instead of refusing to start")
    tensorboard: str | None = OUTPUT(None, "also write the metrics as TensorBoard event files to this folder "
                                         "(needs tensorboardX)")
    wandb: str | None = OUTPUT(None, "also log the metrics to this Weights & Biases project (needs wandb; with "
                                     "WANDB_MODE=offline the run is written under WANDB_DIR for `wandb sync` later, "
                                     "no network needed)")
    peak_tflops: float | None = OUTPUT(None, "one device's dense peak TFLOP/s, for the MFU in the metrics and the "
                                           "summary (default: from a table of accelerators by device kind; none "
                                           "on CPU)")
    init_from: str | None = SAVE(None, "start from these weights: hf:DIR (a HuggingFace Llama folder: config.json and "
                                       "safetensors) or a dpjax checkpoint folder (python -m dpjax.hf import's, or a "
                                       "run's --ckpt-dir); the model and its options come from there")
    lora: str | None = SAVE(None, "train LoRA adapters, the base frozen: r=16,alpha=32,dropout=0.0,targets=q,k,v,o,"
                                  "gate,up,down (PEFT's target_modules names, or all-linear; docs/finetune.md)")
    adapter: str | None = SAVE(None, "with --init-from: start the adapters from this PEFT adapter folder "
                                     "(adapter_config.json, adapter_model.safetensors); --lora defaults to its "
                                     "settings")
    ckpt_dir: str | None = SAVE(None, "folder for checkpoints (orbax)")
    ckpt_every: int = SAVE(100, "steps between checkpoints")
    resume: bool = SAVE(False, "continue from the latest checkpoint in --ckpt-dir (or the newest commit in "
                               "--commit-dir), appending to --metrics; nothing there to resume is an error")
    commit_dir: str | None = SAVE(None, "folder for per-step commits of the training state (dpjax.recovery.commit: "
                                        "each "
                                        "process's shards on local storage plus a copy on the next host's process); "
                                        "under python -m dpjax.agent one is given by default (/dev/shm). A restarted "
                                        "job, or --resume, restores the newest step every shard committed")
    commit_every: int | str = SAVE("auto", "steps between commits (with --commit-dir or under dpjax.agent), or "
                                           "auto: the smallest interval whose measured cost stays within 5 percent "
                                           "of the step time (dpjax.recovery.interval); a failure loses at most the "
                                           "interval plus the step in flight")
    on_full_disk: str = SAVE("stop", "a commit that a full disk refuses: stop the run (one line, the newest commit "
                                     "kept), or skip-commits: that commit is skipped on every process, said, and "
                                     "the run trains on, trying the next (a failure meanwhile loses the steps "
                                     "since the newest commit kept)",
                             choices=("stop", "skip-commits"))
    max_lost_steps: int | None = SAVE(None, "with --commit-every auto: commit often enough that a failure loses at "
                                            "most this many steps, whatever the commits cost (the cost is said)")
    progress: str = OUTPUT("auto", "progress display: a bar on a terminal, log lines otherwise",
                         choices=("auto", "bar", "log", "none"))
    # Timeline and autotune (dpjax.timeline, dpjax.train.autotune)
    timeline: str | None = TIMELINE(None, "write a Chrome trace / Perfetto timeline (a track per device: phases, every "
                                      "collective and ring step, every op) of --timeline-steps profiled steps to "
                                      "this file (.json or .json.gz); summarise it with python -m dpjax.timeline "
                                      "FILE. Only those steps are profiled")
    profile_dir: str | None = TIMELINE(None, "with --timeline: keep the raw profiler capture (jax.profiler) in this "
                                         "folder, to open in XProf / TensorBoard (otherwise it is deleted)")
    timeline_steps: int = TIMELINE(3, "steps --timeline profiles: the ones after the first step (which compiles) and "
                                  "after any autotune")
    autotune_samples: int = TIMELINE(3, "with --allreduce auto or --fusion-mb auto: timed steps per candidate in each "
                                    "round of the search (successive halving; the slower half goes each round)")
    # Processes (dpjax.distributed)
    collectives: str | None = EXCHANGE(None, "CPU collectives between processes: gloo (TCP, works everywhere) or mpi "
                                         "(JAX's MPI collectives through MPItrampoline: needs MPITRAMPOLINE_LIB, see "
                                         "the README's 'Running on a cluster'); GPUs use NCCL whatever this says. "
                                         "Default: dpjax.launch --collectives' choice (DPJAX_COLLECTIVES), else gloo",
                            choices=lambda: tuple(distributed.COLLECTIVES))
    model_options: dict[str, object] = field(default_factory=dict)  # from --d-model etc.: {option: value}
