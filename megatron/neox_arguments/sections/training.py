"""Data, batching, checkpointing, regularisation and post-training keys (GPT-NeoX's ``NeoXArgsTraining``)."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.neox_arguments.fields import arg

DATA_IMPLS = Literal["infer", "mmap", "cached"]
PACK_IMPLS = Literal["packed", "pack_until_overflow", "unpacked"]
DATASET_IMPLS = Literal["gpt2", "pairwise", "online"]
TRAIN_IMPLS = Literal["normal", "dpo", "rm", "kto", "reinforce"]
CHECKPOINT_SCALES = Literal["linear", "log"]
_PAIR = "Pairwise (DPO/RM) data: list of dataset prefixes for the {} {} examples{}."


@dataclass(kw_only=True)
class DataPathKeys:
    """Where the training text is and how it is stored."""

    data_path: str | None = arg(None, "Prefix of one tokenized dataset (`<prefix>.bin/.idx`), split by `split`.")
    train_data_paths: list | None = arg(None, "Dataset prefixes blended for training (with valid/test paths).")
    valid_data_paths: list | None = arg(None, "Dataset prefixes blended for validation.")
    test_data_paths: list | None = arg(None, "Dataset prefixes blended for testing.")
    data_impl: DATA_IMPLS = arg("infer", "Indexed-dataset flavour; `infer` reads the index file's magic bytes.")


@dataclass(kw_only=True)
class PairedDataPathKeys:
    """Chosen/rejected (pos/neg) datasets of pairwise post-training."""

    pos_train_data_paths: list | None = arg(None, _PAIR.format("training", "chosen", ""))
    neg_train_data_paths: list | None = arg(None, _PAIR.format("training", "rejected", ""))
    pos_valid_data_paths: list | None = arg(None, _PAIR.format("validation", "chosen", ""))
    neg_valid_data_paths: list | None = arg(None, _PAIR.format("validation", "rejected", ""))
    pos_test_data_paths: list | None = arg(None, _PAIR.format("test", "chosen", ""))
    neg_test_data_paths: list | None = arg(None, _PAIR.format("test", "rejected", ""))


@dataclass(kw_only=True)
class DataKeys:
    """Labels, weights, splits, packing and loading of the datasets."""

    use_shared_fs: bool = arg(
        True, "Ranks share a filesystem: only global rank 0 builds index caches (else local rank 0 per node)."
    )
    train_label_data_paths: list | None = arg(None, "Label streams matching train_data_paths (-100 = no loss).")
    valid_label_data_paths: list | None = arg(None, "Label streams matching valid_data_paths.")
    test_label_data_paths: list | None = arg(None, "Label streams matching test_data_paths.")
    train_data_weights: list | None = arg(
        None, "Sampling weight per training dataset (default: all 1.0).", derived=True
    )
    valid_data_weights: list | None = arg(
        None, "Sampling weight per validation dataset (default: all 1.0).", derived=True
    )
    test_data_weights: list | None = arg(None, "Sampling weight per test dataset (default: all 1.0).", derived=True)
    weight_by_num_documents: bool = arg(
        False, "Replace the weights by p(group) proportional to (documents in group) ** weighted_sampler_alpha."
    )
    weighted_sampler_alpha: float = arg(
        1.0, "Exponent of weight_by_num_documents: 1 = proportional to size, 0 = uniform over groups."
    )
    pack_impl: PACK_IMPLS = arg(
        "packed", "How documents become samples: concatenated and cut, filled until overflow, or one per sample."
    )
    allow_chopped: bool = arg(True, "Allow samples longer than seq_length to be cut (ignored when packed).")
    mmap_warmup: bool = arg(False, "Read through memory-mapped data once at start.")
    split: str = arg("969, 30, 1", "Train/valid/test proportions of data_path, comma or slash separated.")
    num_workers: int = arg(2, "DataLoader worker processes.")


@dataclass(kw_only=True)
class TrainImplKeys:
    """The training objective."""

    train_impl: TRAIN_IMPLS = arg(
        "normal", "Training objective: language modelling/SFT, DPO, reward model, KTO or REINFORCE."
    )


@dataclass(kw_only=True)
class PostTrainingKeys:
    """DPO, KTO and reward-model settings and data."""

    dataset_impl: DATASET_IMPLS = arg("gpt2", "Dataset kind: plain LM, chosen/rejected pairs, or online (served) data.")
    dpo_fp32: bool = arg(True, "Compute the DPO loss in fp32.")
    dpo_reference_free: bool = arg(False, "DPO without a reference model (reference log-probs = 0).")
    dpo_beta: float = arg(0.1, "DPO temperature beta.")
    kto_fp32: bool = arg(True, "Compute the KTO loss in fp32.")
    kto_desirable_weight: float = arg(1.0, "KTO weight of desirable examples.")
    kto_undesirable_weight: float = arg(1.0, "KTO weight of undesirable examples.")
    z_loss: float = arg(0.0, "Reward-model z-loss coefficient (penalises large rewards).")
    kto_beta: float = arg(0.1, "KTO temperature beta.")
    pos_train_label_data_paths: list | None = arg(None, _PAIR.format("training", "chosen", " (labels)"))
    neg_train_label_data_paths: list | None = arg(None, _PAIR.format("training", "rejected", " (labels)"))
    pos_valid_label_data_paths: list | None = arg(None, _PAIR.format("validation", "chosen", " (labels)"))
    neg_valid_label_data_paths: list | None = arg(None, _PAIR.format("validation", "rejected", " (labels)"))
    pos_test_label_data_paths: list | None = arg(None, _PAIR.format("test", "chosen", " (labels)"))
    neg_test_label_data_paths: list | None = arg(None, _PAIR.format("test", "rejected", " (labels)"))
    train_reward_data_paths: list | None = arg(None, "Reward streams matching train_data_paths (KTO).")
    valid_reward_data_paths: list | None = arg(None, "Reward streams matching valid_data_paths.")
    test_reward_data_paths: list | None = arg(None, "Reward streams matching test_data_paths.")


@dataclass(kw_only=True)
class ReinforceKeys:
    """Online REINFORCE (``train_impl: reinforce``, ``dataset_impl: online``): rollout servers and the loss."""

    fp32_reinforce: bool = arg(True, "Cast the logits to fp32 before the REINFORCE log-probs (and the full KL).")
    kl_impl: Literal["abs", "mse", "kl", "full"] = arg(
        "mse",
        "KL estimator against the frozen reference (used when kl_div_beta > 0): abs |d|, mse d^2/2 or kl d with "
        "d = log p(token) - log p_ref(token), or full: KL(p || p_ref) over the whole vocabulary.",
    )
    kl_div_beta: float = arg(
        0.1, "Weight of the KL penalty in the REINFORCE loss; > 0 keeps a frozen copy of the loaded weights."
    )
    reinforce_leave_one_out: bool = arg(
        False,
        "Baseline of each completion's reward: the mean reward of the other completions of its prompt (RLOO); "
        "false: a moving average of the last 100 prompts' mean rewards.",
    )
    online_dataserver_ips: str | list = arg(
        "localhost", "Host of the online data (rollout) server; a list gives one per data-parallel rank."
    )
    online_dataserver_ports: int | list = arg(
        10000, "Port of the online data server; a list gives one per data-parallel rank."
    )
    serve_model_weights: bool = arg(
        False, "Serve the policy's current weights to rollout servers (each rank on weight_server_port + its rank)."
    )
    weight_server_port: int | list = arg(
        6000, "Base port of the weight server (rank r listens on port + r); a list gives one port per rank."
    )
    online_dataserver_timeout: float = arg(
        600.0,
        "neox-forge: seconds to wait for the online data server, both to connect (it may still be starting) and "
        "for each answer; then the run stops with one line naming host and port.",
    )


@dataclass(kw_only=True)
class LoadSaveKeys:
    """The checkpoint directories."""

    save: str | None = arg(None, "Directory to save checkpoints into.")
    load: str | None = arg(
        None,
        "Directory to load a checkpoint from (its `latest` tag, else the newest valid one). A missing directory is "
        "an error unless it equals `save` or is `auto` (= `save`): then the run starts fresh (auto-resume). "
        "neox-forge: an `s3://bucket/prefix` location (a folder `s3_path` uploads to, holding `latest`) is "
        "downloaded into `s3_cache_dir` first: the checkpoint its `latest` names (or `iteration`'s), checked "
        "against its manifest's sha256.",
    )


@dataclass(kw_only=True)
class CheckpointKeys:
    """When checkpoints are saved, what they hold and how they are loaded."""

    checkpoint_scale: CHECKPOINT_SCALES = arg(
        "linear", "Save at multiples of checkpoint_factor (linear) or at powers of it (log)."
    )
    checkpoint_factor: int | float | None = arg(None, "Checkpoint spacing (see checkpoint_scale).")
    extra_save_iters: list | None = arg(None, "Additional iterations at which to save a checkpoint.")
    no_save_optim: bool = arg(False, "Do not save optimizer state.")
    no_save_rng: bool = arg(False, "Do not save random-generator state.")
    no_load_optim: bool = arg(False, "Do not load optimizer state.")
    no_load_rng: bool = arg(False, "Do not load random-generator state.")
    finetune: bool = arg(False, "Load weights only and restart at iteration 0 (no optimizer/RNG/iteration).")
    keep_last_n_checkpoints: int | None = arg(None, "Delete older checkpoints, keeping this many.")
    load_verify_checksums: bool = arg(
        False,
        "neox-forge: also check every file's sha256 against the checkpoint's manifest.json when loading (sizes are "
        "always checked); a checkpoint that fails is skipped with a warning naming the file, as a truncated one.",
    )
    load_allow_tokenizer_change: bool = arg(
        False,
        "neox-forge: load (resume or finetune from) a checkpoint saved with another tokenizer (another "
        "tokenizer_type, vocabulary size or id -> token table, compared by sha256) with a warning instead of an "
        "error; for changing the tokenizer on purpose (its token ids then mean other tokens).",
    )


@dataclass(kw_only=True)
class S3Keys:
    """Checkpoints uploaded to S3 and loaded from it (credentials only from the environment or the AWS config
    files; see docs/reliability.md)."""

    s3_path: str | None = arg(
        None,
        "S3 location `s3://bucket/prefix` every committed checkpoint of `save` is uploaded to, as "
        "`<s3_path>/<basename of save>/global_step<N>/...` (GPT-NeoX's layout) plus a `latest` object written after "
        "the checkpoint's files: by rank 0 in the background, each file verified (size and MD5 ETag), retried; a "
        "failed upload is one log line and the local checkpoint is kept. The endpoint and credentials come from "
        "the environment or the AWS config files (`AWS_ENDPOINT_URL`, `AWS_PROFILE`, ...).",
    )
    s3_chunk_size: int = arg(
        104857600,
        "Bytes per part of the multipart upload of a checkpoint file larger than it (S3's part sizes: 5 MiB to "
        "5 GiB); smaller files go up in one request.",
    )
    s3_upload_attempts: int = arg(
        5,
        "neox-forge: tries of one file's upload or download, counting every failed request (a part, the "
        "completion, `latest`) and every failed check (size, ETag, sha256); then the checkpoint's upload (or the "
        "load) is given up. Waits 0.5 s, 1 s, 2 s, ... (at most 30 s) between tries.",
    )
    s3_timeout: float = arg(60.0, "neox-forge: seconds an S3 request may wait to connect, and for each read.")
    s3_flush_timeout: float = arg(
        300.0,
        "neox-forge: seconds the end of training (and a GPT-NeoX API `save_checkpoint`) waits for pending checkpoint "
        "uploads before it logs which are not uploaded and ends; shorter than `distributed_timeout_minutes`, since "
        "the other ranks wait for rank 0 meanwhile.",
    )
    s3_cache_dir: str | None = arg(
        None,
        "neox-forge: folder a `load: s3://bucket/prefix` downloads the checkpoint into (under `<bucket>/<prefix>/`); "
        "default `$XDG_CACHE_HOME/neox-forge/s3` (`~/.cache/neox-forge/s3`).",
    )


@dataclass(kw_only=True)
class IterationKeys:
    """How long training runs and when it evaluates."""

    train_iters: int | None = arg(None, "Number of training iterations.")
    train_epochs: int | None = arg(
        None,
        "Number of epochs (alternative to train_iters; packed gpt2 data only). Several datasets of a split (weights "
        "unset or all 1.0) are each read once per epoch.",
    )
    eval_iters: int = arg(100, "Batches per evaluation.")
    eval_interval: int = arg(1000, "Iterations between evaluations.")
    exit_interval: int | None = arg(None, "Exit once the iteration is a multiple of this value.")


@dataclass(kw_only=True)
class TokenizerFileKeys:
    """The tokenizer's files."""

    vocab_file: str | None = arg(None, "Tokenizer vocabulary / tokenizer.json / model file.")
    merge_file: str | None = arg(None, "BPE merges file (GPT2BPETokenizer).")


@dataclass(kw_only=True)
class DropoutKeys:
    """Dropout rates."""

    attention_dropout: float = arg(0.0, "Dropout on attention probabilities.")
    hidden_dropout: float = arg(0.0, "Dropout on the outputs of attention and MLP blocks.")


@dataclass(kw_only=True)
class UpdateRuleKeys:
    """Weight decay."""

    weight_decay: float = arg(0.1, "Decoupled weight decay coefficient.")


@dataclass(kw_only=True)
class MupKeys:
    """muP (megatron/model/mup.py): the model's multipliers, the optimizer's width-scaled groups, the base shapes."""

    use_mup: bool = arg(False, "Use maximal-update parametrisation (muP).")
    coord_check: bool = arg(False, "muP: produce a coordinate-check plot and exit.")
    save_base_shapes: bool = arg(False, "muP: save base shapes to base_shapes_file and exit.")
    base_shapes_file: str | None = arg(None, "muP: base shapes file.")
    mup_init_scale: float = arg(1.0, "muP: multiplier of all initial parameters.")
    mup_attn_temp: float = arg(1.0, "muP: attention temperature.")
    mup_output_temp: float = arg(1.0, "muP: output temperature.")
    mup_embedding_mult: float = arg(1.0, "muP: embedding output multiplier.")
    mup_rp_embedding_mult: float = arg(1.0, "muP: relative-position embedding multiplier.")
    mup_width_scale: int = arg(2, "muP: width multiplier of the delta model.")


@dataclass(kw_only=True)
class RecomputeKeys:
    """Whether and how many layers are recomputed in backward."""

    checkpoint_activations: bool = arg(False, "Recompute layer activations in the backward pass (saves memory).")
    checkpoint_num_layers: int = arg(1, "Layers per activation-checkpoint chunk.")


@dataclass(kw_only=True)
class ActivationCheckpointKeys:
    """DeepSpeed's activation-checkpointing options."""

    partition_activations: bool = arg(False, "Split activation checkpoints across tensor-parallel ranks.")
    contiguous_checkpointing: bool = arg(False, "Keep activation checkpoints in contiguous memory.")
    checkpoint_in_cpu: bool = arg(False, "Move activation checkpoints to CPU memory.")
    synchronize_each_layer: bool = arg(False, "Synchronise at the start and end of each checkpointed layer.")
    profile_backward: bool = arg(False, "Profile the backward pass of checkpointed layers.")


@dataclass(kw_only=True)
class EvalLimitKeys:
    """The lm-eval example limit."""

    eval_limit: int | None = arg(None, "neox-forge: examples per evaluation task (unset: all).")


@dataclass(kw_only=True)
class BatchMaskKeys:
    """Position ids and attention masks at document boundaries."""

    reset_position_ids: bool = arg(False, "neox-forge: restart position ids after each end-of-document token.")
    reset_attention_mask: bool = arg(False, "neox-forge: block attention across documents in a packed sample.")


@dataclass(kw_only=True)
class PreemptionKeys:
    """Stopping on signals and time limits."""

    preemption_signals: list = arg(
        ["SIGTERM", "SIGUSR1"],
        "neox-forge: signals after which every rank saves at the next step boundary and exits with the requeue exit "
        "code 42 ([] disables; see docs/reliability.md).",
    )
    exit_duration_in_mins: float | None = arg(
        None, "neox-forge: wall-clock budget; when it is used up every rank saves and exits with exit code 42."
    )


@dataclass(kw_only=True)
class TrainingArgs(
    DataPathKeys,
    PairedDataPathKeys,
    DataKeys,
    TrainImplKeys,
    PostTrainingKeys,
    ReinforceKeys,
    LoadSaveKeys,
    CheckpointKeys,
    S3Keys,
    IterationKeys,
    TokenizerFileKeys,
    DropoutKeys,
    UpdateRuleKeys,
    MupKeys,
    RecomputeKeys,
    ActivationCheckpointKeys,
    EvalLimitKeys,
    BatchMaskKeys,
    PreemptionKeys,
):
    """Everything about the training run except model shape and optimizer."""

    checkpoint_validation_with_forward_pass: bool = arg(
        False, "Store one forward pass with each checkpoint and check it after loading."
    )
    batch_size: int = arg(None, "Micro-batch size per rank (mirrors train_micro_batch_size_per_gpu).", derived=True)
    deepspeed_activation_checkpointing: bool = arg(True, "Deprecated: DeepSpeed activation checkpointing (always).")
    clip_grad: float = arg(
        1.0,
        "Mirrors `gradient_clipping` (GPT-NeoX sets `clip_grad = gradient_clipping`), which is what clips; a set "
        "`clip_grad` that differs from `gradient_clipping` is refused.",
        derived=True,
    )
    hysteresis: int = arg(2, "Dynamic loss scaling hysteresis (DeepSpeed reads the fp16 dict instead).")
    dynamic_loss_scale: bool = arg(None, "True when loss_scale is unset (derived).", derived=True)
    loss_scale: float | None = arg(None, "Static loss scale; unset means dynamic scaling.")
    loss_scale_window: float = arg(1000.0, "Iterations between dynamic loss-scale increases.")
    min_scale: float = arg(1.0, "Smallest dynamic loss scale.")
    char_level_ppl: bool = arg(False, "Also report character-level perplexity.")
    max_consecutive_nonfinite_steps: int = arg(
        10,
        "neox-forge: a step with a NaN/inf loss or gradient is skipped in any precision (logged with its iteration); "
        "this many in a row abort the run.",
    )
    loss_spike_skip_window: int = arg(
        0,
        "neox-forge: loss-spike skip (0: off). The number of recent applied steps whose losses are the reference; a "
        "step whose loss lies more than loss_spike_skip_zscore standard deviations above their mean is skipped like a "
        "non-finite step and counts toward max_consecutive_nonfinite_steps (see docs/reliability.md).",
    )
    loss_spike_skip_zscore: float = arg(
        6.0, "neox-forge: z-score above which a step's loss is a spike (used when loss_spike_skip_window > 0)."
    )
