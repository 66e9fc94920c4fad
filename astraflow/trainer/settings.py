"""Settings of a trainer: the loss family, the optimizer and schedule, batching, checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, ge=0)
    """PPO clip below 1: ratio >= 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip above 1 (clip-higher: a larger value lets rare tokens grow)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual clip c: for negative advantages the loss is capped at c x |advantage|."""
    correction: Literal["none", "decoupled", "tis", "icepop", "m2po"] = "none"
    """Off-policy correction (`trainer.losses`, each as its paper defines it): `none` = PPO-clip on the
    ratio to the behaviour (engine) logprobs; `decoupled` = AReaL's decoupled PPO; `tis` = truncated
    importance sampling (Yao et al.); `icepop` = IcePop's masked weight; `m2po` = M2PO's second-moment
    mask. All but `none` recompute the proximal logprobs (the trainer's, before the batch's update)."""
    decoupled_cap: float | None = Field(None, gt=0)
    """decoupled: cap on the behaviour weight w = pi_prox / pi_behav; None = no cap (AReaL's default)."""
    decoupled_cap_mode: Literal["clamp", "drop"] = "drop"
    """decoupled: `drop` = tokens with w above the cap get weight 0 (AReaL); `clamp` = weight min(w, cap)."""
    tis_cap: float = Field(2.0, gt=0)
    """tis: the truncation C of the engine/trainer weight, min(w, C) (the paper's C = 2)."""
    icepop_low: float = Field(0.5, gt=0)
    """icepop: tokens with w below this are masked (the report's alpha)."""
    icepop_high: float = Field(5.0, gt=0)
    """icepop: tokens with w above this are masked (the report's beta)."""
    m2po_threshold: float = Field(0.04, gt=0)
    """m2po: the tokens with the largest (log w)^2 are masked until the mean over the rest is at most this
    (the paper's tau_M2)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a KL penalty to the frozen reference (the starting weights)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sequence (geometric mean of its tokens' ratios)."""
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"

    @model_validator(mode="after")
    def _icepop_bounds(self) -> LossSettings:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low {self.icepop_low} must be below icepop_high {self.icepop_high}")
        return self


class LoraSettings(BaseModel):
    """LoRA through the `peft` package: the base stays frozen, the optimizer holds the adapter only, and
    every published version is the adapter (a PEFT `adapter_model.safetensors`)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1)
    """The adapter's rank r (PEFT's `r`)."""
    alpha: float = Field(32.0, gt=0)
    """PEFT's `lora_alpha`: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """PEFT's `lora_dropout` on the adapter's input while training."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names the adapter wraps (PEFT's `target_modules`): by default the attention and MLP
    projections of Llama/Qwen-style models."""
    base_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Precision of the frozen base weights; the adapter's parameters and optimizer state stay float32."""
    b_lr_ratio: float = Field(1.0, gt=0)
    """LoRA+ (Hayou et al., 2024): the B matrices learn at this many times `trainer.lr` (the paper's
    lambda, 16 in its experiments); 1 = plain LoRA."""


class TrainerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["async", "sync"] = "async"
    """`sync` runs generation, training and weight sync in lockstep (staleness 0): the baseline."""
    model: str = ""
    """The starting weights (a Hugging Face directory); default `engine.model`."""
    loss: LossSettings = Field(default_factory=LossSettings)
    lora: LoraSettings | None = None
    """Train a LoRA adapter of the frozen starting weights instead of all of them (None: full
    fine-tuning). Each version is then the adapter, a few MB, and the engines load it as one."""
    lr: float = Field(2e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up from 0 over this many optimizer steps, then constant."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the gradient norm to this; None = no clipping."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch (the batch split in this many parts); one new version per batch."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """Padded tokens per forward/backward (sequences bucketed by length; gradients accumulate)."""
    share_prefix: bool = True
    """Run each prompt's forward once for all the samples of a micro-batch that share it (GRPO groups);
    the result is the same, the work smaller by about (n - 1) / n of the prompt tokens. A single trainer
    process without gradient checkpointing only (FSDP ranks, and checkpointed layers, which drop the
    prompt's key/value cache, run the plain path)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer computes: `auto` = CUDA when every local rank has a GPU, else the CPU. Under
    torchrun each rank uses `cuda:LOCAL_RANK` (ranks talk over NCCL; gloo on the CPU)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision of forwards and backwards. Parameters and optimizer state stay float32."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them: less memory
    for about one more forward."""
    checkpoint_every: int = Field(1, ge=1)
    """Versions between checkpoints. Every version is published; one that no checkpoint holds yet is
    rolled back on every RaaS when a restarted trainer resumes from an older checkpoint (versions carry
    the trainer's incarnation), and its batches are trained again, once, into the surviving weights."""
    keep_checkpoints: int = Field(2, ge=1)
    checkpoint_dir: Path | None = None
    """Default `<run dir>/checkpoints/<model>`."""
    adopt_checkpoint: bool = False
    """Resume from a checkpoint that names no run (written before runs had a nonce): it could be any
    run's, so it is refused unless this is set (`--set trainer.adopt_checkpoint=true`)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many versions; None = run until stopped."""
    threads: int = Field(0, ge=0)
    """torch threads; 0 = torch's default."""
    devices: str = ""
    """The GPUs the trainer process uses (CUDA_VISIBLE_DEVICES, e.g. "0" or "4,5,6,7"); "" = inherited."""
    collective_timeout_s: float = Field(600.0, gt=0)
    """Under torchrun: the longest a collective waits for the other ranks before it raises (NCCL's own
    default), and how long a rank > 0 waits for a sign of life of rank 0 (which may wait on Redis for a
    batch as long as it likes) before it ends with an error."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of the trainer's Prometheus /metrics endpoint (its steps: version, loss, reward, ...; labels
    run, worker, policy); 0 = not served. Two trainers on one host need two ports (per policy:
    `run.models.<name>.trainer.metrics_port`)."""
    metrics_host: str = "127.0.0.1"
    """Address the /metrics endpoint listens on: this host only; `0.0.0.0` (all interfaces) lets a
    Prometheus in another pod scrape it."""
