"""Structured configs: the schema of every config group, its defaults and its validation.

Hydra checks types, enum values and unknown keys against these dataclasses; `validate_groups` checks what a
type cannot say (ranges, cross-field rules) within the groups, privacy's cross-key rules aside
(`dpmem.privacy.calibrate.check`, with what depends on the method), and each method's class the rest of what
depends on the method (`dpmem.methods.validate` runs them all). Each ends in a `ConfigError` whose message names the key and what is
allowed, which the CLI prints as one line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A bad configuration value: the message names the key and what is allowed."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


class Accountant(Enum):
    auto = "auto"  # rc for dp-sgd-rc, pld for every other method
    pld = "pld"
    rdp = "rdp"
    rc = "rc"  # DP-SGD-RC: PLD over the random sensitivity of randomized clipping (envelope of Prop. 5.2)


class Noise(Enum):  # dpmem.privacy.strategies: how a step's noise is correlated with earlier steps'
    independent = "independent"  # fresh noise every step (DP-SGD)
    bandmf = "bandmf"  # banded matrix factorization: b bands, b − 1 noise buffers (or r×n ones under grape)
    bisr = "bisr"  # banded inverse square root: the last p draws regenerated from their keys, no buffer


class Unit(Enum):  # what ε protects (docs/privacy.md, "The privacy unit")
    record = "record"  # one training record
    user = "user"  # everything one user wrote (the data's user column, or data.users)


class UserSampling(Enum):  # privacy.unit=user: how a step samples and clips (Charles et al. 2024)
    users = "users"  # ULS: Poisson-sample users, clip each user's summed gradient (at most k records a step)
    records = "records"  # ELS: Poisson-sample records, clip each; a user's ≤ k records accounted as a mixture


class Neighbouring(Enum):
    add_remove = "add_remove"
    replace_one = "replace_one"


class Sampling(Enum):
    auto = "auto"  # poisson for private methods (cyclic with correlated noise), shuffle for non-private ones
    poisson = "poisson"  # each example joins a step independently with rate q = B/n
    fixed = "fixed"  # B examples drawn without replacement at every step (RDP, replace_one)
    shuffle = "shuffle"  # epochs of shuffled fixed-size batches: no privacy accounting exists, non-private only
    # the records split by a keyed permutation into G fixed groups; step t samples group t mod G at rate
    # B / floor(n/G): what correlated noise (privacy.noise) is accounted with (dpmem.privacy.sampling)
    cyclic = "cyclic"


class Schedule(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Device(Enum):  # where a run trains (meta, shapes without values, is dpmem memory's: memory.device)
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):  # dpmem.precision
    fp32 = "fp32"  # float32, TF32 off
    tf32 = "tf32"  # float32 tensors, CUDA matmuls and convolutions in TF32
    bf16 = "bf16"  # autocast to bfloat16 (cpu or cuda); parameters, optimiser state and private arithmetic float32


class Direction(Enum):
    gaussian = "gaussian"  # z ~ N(0, I), as the public DPZero code does
    sphere = "sphere"  # uniform on the sphere of radius sqrt(d), as the DP-GRAPE paper describes DPZero


class Clipping(Enum):
    materialize = "materialize"  # one backward pass keeps every parameter's per-sample gradients
    bk = "bk"  # one pass (book-keeping) keeps linear-like layers' inputs A, output gradients G: exact norms, (c ⊙ G)ᵀA
    fgc = "fgc"  # two passes; each layer's per-sample gradient materialised for its norm only, then freed
    ghost = "ghost"  # two passes; norms of linear-like layers from T×T Gram matrices (ghost clipping)
    mixed = "mixed"  # two passes; per layer the cheaper of fgc and ghost (rows·cols vs 2T²)


class Estimator(Enum):
    hutch = "hutch"  # Hutchinson: k Gaussian probes
    hutchpp = "hutchpp"  # Hutch++: k probes for a range sketch, k for the residual


class Optimizer(Enum):
    adam = "adam"
    adamw = "adamw"
    sgd = "sgd"


class SubspaceWhere(Enum):
    clipped = "clipped"  # Li et al.: project the clipped sum; the noise stays in all p dimensions
    privatised = "privatised"  # project the noisy gradient: noise only in the k directions


class SpectrumMode(Enum):
    layer = "layer"  # DP-GRAPE Fig. 1: each projected layer's (clipped, noised) batch gradient at given steps
    trajectory = "trajectory"  # Li et al. §4.2: PCA of the clipped mean gradients of a whole private run


@dataclass
class SubspaceConfig:
    """Subspace re-training (dp-adam, dp-sgd, galore-dp-naive, dp-sgd-rc): project onto the top-k directions of a
    `dpmem spectrum mode=trajectory` run's subspace.pt."""
    path: Optional[str] = None  # None = no projection
    k: Optional[int] = None  # directions used; None = all stored
    where: SubspaceWhere = SubspaceWhere.clipped  # what is projected onto the k directions


@dataclass
class LoraConfig:
    """LoRA adapters through peft (DP-LoRA with a private method): only the adapters (and modules_to_save) train."""
    r: Optional[int] = None  # adapter rank; None = no LoRA (full fine-tuning)
    alpha: float = 8.0  # LoRA's scale: the adapters' product is multiplied by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: Optional[list[str]] = None  # module-name suffixes (peft's rule); None = peft's default per family
    modules_to_save: Optional[list[str]] = None  # fully trained besides the adapters; None = the classifier head if any


@dataclass
class ModelConfig:
    name: str = MISSING  # the model's name (model=NAME's file sets it), recorded in the summary
    family: str = MISSING  # which builder in dpmem.models makes it (vit, roberta, bert, opt, llama, median; auto: any checkpoint)
    pretrained: Optional[str] = None  # hub id or local path; None = random init from `arch`
    tokenizer: Optional[str] = None  # hub id or local path of the tokenizer; None = the one of `pretrained`
    head: str = "classifier"  # text models: classifier | mlm (prompt over label words) | causal (LM loss)
    arch: dict[str, Any] = field(default_factory=dict)  # architecture fields of the transformers config
    lora: LoraConfig = field(default_factory=LoraConfig)
    # fnmatch patterns of the parameter names trained; the rest is frozen. None = all (or LoRA's choice).
    # E.g. the DP-SGD-RC paper's BillSum run trains Llama-3.2-1B's last five layers: ["model.layers.1[1-5].*"]
    trainable: Optional[list[str]] = None
    # fnmatch patterns of parameter names kept frozen (after `trainable`): what the attribution proof names when a
    # layer's gradient cannot be split by sample, e.g. DeBERTa-v3's ["deberta.encoder.rel_embeddings.*"]
    frozen: Optional[list[str]] = None


@dataclass
class Columns:
    """data=csv|jsonl: the column of the file that holds each field (data.columns.text=review)."""
    text: str = "text"  # the input text
    text_pair: Optional[str] = None  # the second text of a pair task
    label: str = "label"  # the class label
    user: Optional[str] = None  # who wrote each record (privacy.unit=user); None = no user column


@dataclass
class DataConfig:
    name: str = MISSING  # the data set dpmem.data loads (data=NAME's file sets it)
    path: Optional[str] = None  # local file (or folder) read instead of the hub / torchvision download
    root: str = "~/.cache/dpmem"  # torchvision data sets: downloaded into and read from here
    test_fraction: float = 0.2  # held-out share for data sets without a fixed test split
    # the data is public (a search's proxy): recorded in the summary; dpmem report composes nothing for its runs
    public: bool = False
    split_seed: int = 0  # the train/test split is fixed by this seed, independent of train.seed
    # text tasks (dpmem.data.tasks): which examples are used
    k: Optional[int] = None  # few-shot: k training examples per class (LM-BFF/MeZO); None = no per-class sampling
    fewshot_seed: int = 42  # seed of the k-shot draw (the papers: 13, 21, 42; 100 for the search's dev set)
    n_test: Optional[int] = 1000  # test examples drawn (with split_seed) from the test split; None = all
    n_dev: Optional[int] = None  # dev examples (per class when k is set) drawn from the training split, disjoint
    eval_split: str = "test"  # evaluated during and after training: test | dev
    max_length: int = 256  # tokens per example; the longest text field is truncated to fit
    max_new_tokens: int = 50  # generation tasks: greedy decoding length
    template: Optional[str] = None  # prompt with {field} and {mask}; None = the task's template for the model's head
    label_words: Optional[list[str]] = None  # one per class; None = the task's
    columns: Columns = field(default_factory=Columns)  # csv/jsonl
    # data=synthetic: the shape of random inputs (images for image models, token ids for text models)
    image_size: int = 32
    channels: int = 3  # synthetic: image channels
    seq_len: int = 128  # synthetic: tokens per text example
    num_classes: int = 10  # synthetic: classes of the random labels
    n_train: Optional[int] = None  # synthetic: examples made; text tasks: training examples drawn (None = all)
    # users made up for a data set without a user column (privacy.unit=user): the training records given to this
    # many users by Zipf's law (split_seed), a few writing many, most one or two (dpmem.data.users)
    users: Optional[int] = None
    # data=median (Li et al. 2022 §4.1): β ∈ R^dimension, A = diag of 1 (const), 1/√k (sqr) or 1/k (linear), the
    # examples' first d_min coordinates drawn N(1, 1), the ridge weight alpha of (α/2)‖β‖²
    dimension: int = 100
    A: str = "const"  # median: the diagonal A, const | sqr | linear
    d_min: int = 10  # median: coordinates drawn N(1, 1); the rest are 0
    alpha: float = 0.0  # median: α, the ridge weight


@dataclass
class MethodConfig:
    """What every method has. Each method family has its own config below, named by its dpmem/conf/method/*.yaml (and
    its class's `config` attribute), so an option of another method is an error, not silently ignored."""
    name: str = MISSING  # the method (method=NAME's file sets it)


@dataclass
class Clipped:
    """Private methods: the clipping threshold C (for dpzero, of the per-sample scalar (L⁺ − L⁻)/2λ)."""
    max_grad_norm: float = 1.0  # C: each per-sample gradient (dpzero: scalar) clipped to norm C


@dataclass
class PerSample(Clipped):
    """First-order private methods: per-sample gradients of every trainable parameter."""
    # Before the first release, prove that each per-sample gradient is its own sample's: Σᵢ wᵢgᵢ against autograd's
    # ∇Σᵢ wᵢℓᵢ at public random w, one backward pass, again where a micro-batch's layers are read anew (a loss or
    # module that mixes samples, rows that are not samples, a weight used outside its module: refused, named).
    check_coverage: bool = True


@dataclass
class Privatised(PerSample):
    """Methods that form the full-dimensional privatised gradient (which subspace re-training can project)."""
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)


@dataclass
class OptimizerConfig(MethodConfig):
    """adam: a stock torch optimiser on the batch gradient."""
    optimizer: Optimizer = Optimizer.adam  # the torch optimiser the batch gradient goes to
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw: the moments' decay rates β1, β2
    eps: float = 1e-8  # adam, adamw: added to the denominator (not privacy's ε)
    weight_decay: float = 0.0  # torch's: L2 in the gradient (adam, sgd), decoupled (adamw)
    momentum: float = 0.0  # sgd only


@dataclass
class DPAdamConfig(OptimizerConfig, Privatised):
    """dp-adam, dp-sgd: the privatised gradient, then the optimiser."""
    # how per-sample clipping is computed (same result, other cost): bk, the fastest within 10% of ghost's memory
    clipping: Clipping = Clipping.bk


@dataclass
class DPSGDRCConfig(OptimizerConfig, Privatised):
    """dp-sgd-rc: per-sample squared norms of linear-like layers estimated with k probes."""
    estimator: Estimator = Estimator.hutch  # how each squared norm is estimated
    k: int = 32  # probes of each estimate, fresh every step
    # one backward pass: the estimates from each layer's kept factors, the clipped sums (c ⊙ G)ᵀA from them (as
    # dp-adam's clipping=bk); the same mechanism as the paper's two passes, faster, at about ghost's memory
    bookkeeping: bool = False


@dataclass
class ProjectedConfig(MethodConfig):
    """galore: projected Adam over rank-r projections, refreshed every F steps."""
    rank: int = 16  # r: each projected matrix's gradient is kept at rank r
    refresh: int = 100  # F: the projections are renewed every F steps
    # fnmatch patterns of the module names projected; None = every Linear/Conv1D except the output head
    projected: Optional[list[str]] = None
    betas: tuple[float, float] = (0.9, 0.999)  # projected Adam's moment decay rates β1, β2
    eps: float = 1e-8  # projected Adam's denominator term (not privacy's ε)
    weight_decay: float = 0.0  # projected Adam's decoupled weight decay


@dataclass
class GaLoreDPNaiveConfig(ProjectedConfig, Privatised):
    """galore-dp-naive: privatised as dp-adam, then GaLore on the privatised gradient."""
    clipping: Clipping = Clipping.materialize  # as dp-adam's method.clipping


@dataclass
class GrapeConfig(ProjectedConfig, PerSample):
    """grape: per-sample gradients projected by P ~ N(0, 1/r) inside the backward pass."""
    project_embeddings: bool = False  # also project embedding / tied LM-head matrices (beyond the paper)


@dataclass
class ZerothOrderConfig(MethodConfig):
    """mezo: perturbation size lambda and the direction's distribution."""
    zo_eps: float = 1e-3  # λ: the step of the finite difference (L⁺ − L⁻)/2λ
    direction: Direction = Direction.gaussian  # the distribution of the perturbation z


@dataclass
class DPZeroConfig(ZerothOrderConfig, Clipped):
    """dpzero: MeZO's per-sample finite differences, clipped to [-C, C]."""


METHOD_SCHEMAS = {"optimizer": OptimizerConfig, "dp-adam": DPAdamConfig, "dp-sgd-rc": DPSGDRCConfig,
                  "projected": ProjectedConfig, "galore-dp-naive": GaLoreDPNaiveConfig, "grape": GrapeConfig,
                  "zeroth-order": ZerothOrderConfig, "dpzero": DPZeroConfig}  # method/*.yaml: schema/NAME


class LossRelease(Enum):
    private = "private"  # per-sample losses clipped to [0, loss_bound], summed, noised, in epsilon (accounting.py)
    exact = "exact"  # outside epsilon: recorded as train_loss_outside_epsilon, never a search's objective
    none = "none"  # not computed into any record


@dataclass
class PrivacyConfig:
    epsilon: Optional[float] = None  # the run's budget: σ is calibrated to it. None = non-private (or σ fixed below)
    # a fixed noise multiplier σ instead of a budget (Opacus' make_private(noise_multiplier=...)): the run spends the
    # ε that σ, its sampling rate and its steps give, accounted as any run's. With privacy.epsilon too: refused
    noise_multiplier: Optional[float] = None
    # a number in (0, 1); "auto" = min(1e-5, 1/n^1.1), below 1/n for every training-set size n; "1/n" only to
    # reproduce papers that used it (a mechanism that publishes one random record whole satisfies δ = 1/n)
    delta: Any = "auto"
    accountant: Accountant = Accountant.auto  # how ε is computed from σ, the sampling and the steps
    neighbouring: Neighbouring = Neighbouring.add_remove  # neighbours: one record added or removed, or one replaced
    # rc: d of the envelope. model = sound for the whole model (inf unless one matrix is trained alone); max_layer =
    # the DP-SGD-RC paper's max over estimated layers of min(p, d); a positive integer (dpmem.methods.rc.rc_dimension)
    rc_dimension: Any = "model"
    noise_seed: Optional[int] = None  # None = seeded from the OS so the noise cannot be replayed
    # None = a private run's Poisson sampler is seeded from the OS, so which steps held a record stays secret (what
    # amplification by subsampling assumes); a number makes the batches reproducible, and derivable from the config
    sampler_seed: Optional[int] = None
    # a private run's training loss (metrics, summary, progress bar, wandb, a search's objective): LossRelease
    train_loss: LossRelease = LossRelease.private
    loss_bound: float = 5.0  # L: each per-sample loss is clipped to [0, L]
    loss_noise: float = 10.0  # c: std c·σ·L on the loss sum, σ the gradient noise multiplier (c = 10: 0.5% more σ)
    # correlated noise (DP matrix factorization, docs/privacy.md): independent | bandmf | bisr, with
    # train.sampling=cyclic; bands: bandmf's b (C's bands, b − 1 buffers), bisr's p (C⁻¹'s, p draws per step)
    noise: Noise = Noise.independent
    bands: Optional[int] = None  # b or p (above); null for independent noise
    # what ε protects: a record, or a user's whole contribution (the data's user column or data.users); a user's
    # records: at most records_per_user (k) of them count, by user_sampling (ULS: per step; ELS: over the run)
    unit: Unit = Unit.record
    user_sampling: UserSampling = UserSampling.users
    records_per_user: Optional[int] = None  # k (above): the rest of a user's records are left out


class Objective(Enum):
    metric = "metric"  # maximised (hydra/sweeper=optuna's default direction); data=median's is a loss: minimise
    train_loss = "train_loss"  # minimised


@dataclass
class TrainConfig:
    steps: Optional[int] = None  # logical steps; if None, derived from epochs
    epochs: Optional[float] = None  # passes over the data: steps = ⌈epochs · n / B⌉ when steps is None
    batch_size: int = 128  # logical (expected, under Poisson sampling) batch size B
    physical_batch_size: Optional[int] = None  # micro-batch size; None = whole logical batch at once
    lr: float = 1e-3  # learning rate: the peak of the schedule
    schedule: Schedule = Schedule.constant  # after warm-up: constant, or linear or cosine decay to 0
    warmup_steps: int = 0  # the lr rises linearly over the first N steps
    seed: int = 0  # model init and data sampling
    eval_every: int = 0  # evaluate every N logical steps (0 = only at the end)
    # None = the physical batch size: evaluating a batch keeps far less than a training step on it, so a run sized
    # by its training peak does not run out of memory at its final evaluation (a generation's KV cache can still
    # outgrow it: dpmem memory plans both, and reports the larger)
    eval_batch_size: Optional[int] = None
    sampling: Sampling = Sampling.auto  # how each step's batch is drawn; accounted as drawn
    device: Device = Device.auto
    precision: Precision = Precision.fp32  # fp32 | tf32 (CUDA) | bf16 (autocast): dpmem.precision
    # recompute each block's activations in the backward pass instead of keeping them (first-order methods)
    activation_checkpointing: bool = False
    # under torchrun: shard parameters, gradients and optimiser state over the ranks with FSDP2 (dpmem.sharding)
    fsdp: bool = False
    # every micro-batch at the physical batch size and the split's full token width: the short one padded with
    # samples that weigh 0 (the accountant is unchanged), so that the step has one shape (a CUDA graph's need)
    static_shapes: Optional[bool] = None  # None: true under train.compile, false otherwise
    # compile each micro-batch's forward, per-sample backward and clipping whole (torch.compile fullgraph;
    # dpmem.compiling; the noise is added outside the graph); implies static_shapes. On the CPU the compile time
    # (tens of seconds) outweighs short runs
    compile: bool = False
    compile_backend: str = "inductor"  # inductor (CUDA graphs on CUDA) | aot_eager | eager (trace only: tests)
    # faults: checkpoint.pt in the run folder every N steps (0 = never); a run started again in the same folder
    # (the same hydra.run.dir / hydra.sweep.dir) resumes from it, privacy accounting included
    checkpoint_every: int = 0
    resume: bool = True  # resume from the folder's checkpoint.pt, if any (false: a fresh run, needing train.overwrite)
    skip_done: bool = False  # a run whose folder holds its finished run (status ok, this configuration) is skipped
    overwrite: bool = False  # a fresh run may replace the records of an earlier one in its folder
    save_model: bool = False  # the final weights in model.pt (a private search's trials: the winner's is released)
    # what `dpmem train` returns to a sweeper (hydra/sweeper=optuna): the final evaluation metric, or the last
    # logged training loss (DP-SGD-RC's search); a run that did not finish ok returns the worst value
    objective: Objective = Objective.metric


class WandbMode(Enum):
    online = "online"
    offline = "offline"  # written under the run folder; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class WandbConfig:
    """Weights & Biases: the run's config, every metrics.jsonl record and the final summary. Off by default."""
    enabled: bool = False  # send the run to W&B
    project: str = "dpmem"  # the W&B project
    entity: Optional[str] = None  # the W&B team or user; None = the login's default
    group: Optional[str] = None  # e.g. the experiment's name, to group a sweep
    tags: list[str] = field(default_factory=list)  # the W&B run's tags
    mode: WandbMode = WandbMode.online  # online: uploaded as the run goes


@dataclass
class LoggingConfig:
    progress: bool = True  # progress bar with loss, epsilon spent and samples/s
    every: int = 10  # write metrics.jsonl (and update epsilon spent) every N logical steps
    memory_steps: int = 3  # on CPU, count live tensor bytes over the first N steps (the counter slows ops)
    wandb: WandbConfig = field(default_factory=WandbConfig)


class PlanTarget(Enum):
    cuda = "cuda"
    cpu = "cpu"


class PlanDevice(Enum):
    meta = "meta"  # shapes only: any model, no weights, nothing allocated
    cpu = "cpu"  # the same steps on real tensors (small models), to check a plan


@dataclass
class MemoryConfig:
    """dpmem memory: plan peak memory by running real steps on the meta device."""
    steps: int = 3  # steps run; all but the first are metered, so optimiser state exists
    budget: Optional[str] = None  # e.g. 24GB (= 24 GiB, as GPU sizes are quoted): the largest batch that fits
    allocator_overhead: float = 0.1  # CUDA caching allocator: reserved ≈ tensor bytes × (1 + this)
    # what the plan is for: cuda rounds every storage up to 512 bytes and picks CUDA's attention kernel; cpu
    # counts exact bytes with the CPU's kernel (to compare with a CPU run)
    target: PlanTarget = PlanTarget.cuda
    device: PlanDevice = PlanDevice.meta  # what the planned steps run on
    # > 1: the peak of one rank of a train.fsdp=true run over this many ranks (simulated in one process)
    world_size: int = 1
    dir: Optional[str] = None  # output folder; None = outputs/memory/DATE/TIME


class PlanFor(Enum):
    """The device a `dpmem plan` is for (dpmem.engine.roofline.DEVICES: peaks and bandwidths with their sources)."""
    h100 = "h100"
    h200 = "h200"
    a100 = "a100"
    l4 = "l4"
    cpu = "cpu"  # this host, measured when the plan starts


@dataclass
class PlanConfig:
    """dpmem plan: the fastest configuration that fits memory.budget on plan.device, from planned peaks (meta) and
    roofline step times counted in the same steps."""
    device: PlanFor = PlanFor.h100
    # each candidate: overrides of one configuration; each is planned with and without activation checkpointing
    candidates: list[str] = field(default_factory=lambda: [
        "method=dp-adam method.clipping=bk", "method=dp-adam method.clipping=ghost",
        "method=dp-adam method.clipping=mixed", "method=dp-adam method.clipping=materialize", "method=grape",
        "method=galore-dp-naive method.clipping=bk", "method=dp-sgd-rc method.bookkeeping=true", "method=dpzero"])
    checkpointing: list[bool] = field(default_factory=lambda: [False, True])  # train.activation_checkpointing of each
    precisions: list[Precision] = field(default_factory=lambda: [Precision.fp32, Precision.tf32])  # the cpu: fp32
    top: int = 3  # the commands of the best few
    dir: Optional[str] = None  # output folder; None = outputs/plan/DATE/TIME


@dataclass
class SpectrumConfig:
    """dpmem spectrum: singular values of gradients, and what clipping and noise do to them."""
    mode: SpectrumMode = SpectrumMode.layer  # what is measured
    dir: Optional[str] = None  # output folder; None = outputs/spectrum/DATE/TIME_MODE
    # layer: the top singular values of each measured layer's batch gradient
    layers: Optional[list[str]] = None  # fnmatch patterns of module names; None = those grape projects by default
    top: int = 64  # singular values kept per layer
    steps: list[int] = field(default_factory=lambda: [1])  # measured before these (1-based) steps' updates
    clip: Optional[list[Optional[float]]] = None  # C values (null = no clipping); None = [null, method.max_grad_norm]
    sigma: Optional[list[float]] = None  # noise multipliers; None = [0, the sigma privacy gives]
    # trajectory: the clipped mean gradient of every step of the run, stored in chunks, then PCA
    params: Optional[list[str]] = None  # fnmatch patterns of the recorded parameters; None = all trained
    chunk: int = 100  # gradients per file on disk (memory is bounded by one chunk)
    k: int = 100  # principal components
    iterations: int = 10  # orthogonal iterations (Li et al. 2022, App. B.2: 10 ≈ 100)
    ks: list[int] = field(default_factory=lambda: [1, 10, 20, 100])  # G_k reported for these k
    gradients: Optional[str] = None  # analyse the chunks of an earlier trajectory folder instead of training
    seed: int = 0  # noise of the layer mode, start of the orthogonal iteration


class CanaryKind(Enum):
    gradient = "gradient"  # white-box: a planted per-sample gradient, scored on the released gradients
    input = "input"  # black-box: mislabelled training examples, scored by the final model's loss on them


class CanaryPlant(Enum):
    """Where gradient canaries join the private step."""
    auto = "auto"  # batch where the method can (its Privatizer's unprojected sums, one process), else sum
    batch = "batch"  # as samples of the micro-batches: made by the host weight's layers, normed, clipped, summed
    sum = "sum"  # added to the clipped sum, normed and clipped by the Privatizer's code (clipped_sum_of)


@dataclass
class AuditConfig:
    """dpmem audit: one training run with m canaries, each in the training set with probability ½, and the
    empirical lower bound on epsilon that scoring them gives (one-run auditing, Steinke, Nasr, Jagielski 2023)."""
    kind: CanaryKind = CanaryKind.gradient  # what the canaries are
    canaries: int = 1000  # m
    norm: float = 10.0  # a gradient canary's norm, in units of method.max_grad_norm (clipping brings it to C)
    plant: CanaryPlant = CanaryPlant.auto  # where gradient canaries join the step (CanaryPlant)
    uses: int = 16  # plant=batch: the layer calls that make a canary's gradient (uses of its host weight)
    beta: float = 0.05  # the bound holds with probability 1 - beta
    seed: int = 0  # which canaries are in, where they live
    dir: Optional[str] = None  # output folder; None = outputs/audit/DATE/TIME (a sweep: one sub-folder per point)


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    method: MethodConfig = MISSING
    privacy: PrivacyConfig = MISSING
    train: TrainConfig = MISSING
    logging: LoggingConfig = MISSING
    memory: MemoryConfig = MISSING
    plan: PlanConfig = MISSING
    spectrum: SpectrumConfig = MISSING
    audit: AuditConfig = MISSING
    debug: bool = False  # show tracebacks for configuration errors


def register_configs() -> None:
    """The root schema types every group's node, so each group's YAML files are validated against it; each
    dpmem/conf/method/*.yaml names its method family's schema (`defaults: [schema/NAME, _self_]`)."""
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for name, schema in METHOD_SCHEMAS.items():
        store.store(group="method/schema", name=name, node=schema, package="method")


def resolved_sampling(cfg, private: bool) -> str:
    """train.sampling with auto resolved: poisson for a private method (cyclic with correlated noise, what its
    accounting needs), shuffled epochs for a non-private one. The one place auto is decided."""
    sampling = enum_value(cfg.train.sampling)
    if sampling != "auto":
        return sampling
    if not private:
        return "shuffle"
    return "poisson" if enum_value(cfg.privacy.get("noise", "independent")) == "independent" else "cyclic"


def enum_value(x: Any) -> Any:
    """An Enum field's value (configs built without the schema, e.g. in tests, hold plain strings)."""
    return x.value if isinstance(x, Enum) else x


DELTA_FORMS = "a number in (0, 1), 'auto' (min(1e-5, 1/n^1.1)) or '1/n'"


def resolve_delta(delta: Any, n: int) -> float:
    """δ for a training set of n examples."""
    if isinstance(delta, str):
        if delta.strip() == "auto":
            return min(1e-5, n ** -1.1)
        if delta.strip() == "1/n":
            return 1.0 / n
        try:
            delta = float(delta)
        except ValueError:
            raise ConfigError("privacy.delta", f"{delta!r}: allowed {DELTA_FORMS}") from None
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ConfigError("privacy.delta", f"{delta} is outside (0, 1); allowed {DELTA_FORMS}")
    return delta


def asked_budget(p: Any) -> str | None:
    """What a privacy config asks to spend, as its key says it: "privacy.epsilon=8" (σ calibrated to it),
    "privacy.noise_multiplier=1" (a fixed σ, the ε it gives computed), or None (privacy=none)."""
    if p.get("epsilon") is not None:
        return f"privacy.epsilon={p.epsilon:g}"
    return f"privacy.noise_multiplier={p.noise_multiplier:g}" if p.get("noise_multiplier") is not None else None


def accounted(p: Any) -> bool:
    """Whether a privacy config asks for an accounted run (`asked_budget`). Neither key: privacy=none."""
    return asked_budget(p) is not None


def no_such_key(schema: type, node: Any, key: str, said: str) -> str:
    """The refusal of a key that `schema` (a dataclass) does not read: `said`, or a method's "NAME has no option",
    then the keys it allows."""
    allowed = "; allowed: " + ", ".join(sorted(f.name for f in dataclasses.fields(schema)))
    if issubclass(schema, MethodConfig) and node is not None and "name" in node:
        return f"{node['name']} has no option {key!r}" + allowed
    return said + allowed


def check_schema_keys(node: Any, prefix: str = "") -> None:
    """Every key of a composed config is one its schema reads. `+KEY=VALUE` adds a key that Hydra lets into a
    structured config, where nothing reads it (`+privacy.epsilonn=1` would train at the default ε): refused as the
    misspelt key without `+` is. A free-form dict (model.arch) and a config built without the schema are not
    checked. Raises ConfigError."""
    schema = OmegaConf.get_type(node)
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(schema)):
        return
    fields = {f.name for f in dataclasses.fields(schema)}
    for key, child in node.items_ex(resolve=False):
        if key not in fields:
            raise ConfigError(f"{prefix}{key}", no_such_key(schema, node, key, f"Key {key!r} not in "
                                                            f"{schema.__name__!r} (a '+' adds a key nothing reads)"))
        check_schema_keys(child, f"{prefix}{key}.")


def validate_groups(cfg: Any) -> None:
    """The groups' checks (the module's docstring), spectrum's and memory's where the config has them."""
    check_schema_keys(cfg)
    t = cfg.train
    if t.steps is None and t.epochs is None:
        raise ConfigError("train.steps", "set train.steps or train.epochs")
    if t.steps is not None and t.steps <= 0:
        raise ConfigError("train.steps", f"{t.steps} must be a positive integer")
    if t.epochs is not None and t.epochs <= 0:
        raise ConfigError("train.epochs", f"{t.epochs} must be positive")
    if t.batch_size <= 0:
        raise ConfigError("train.batch_size", f"{t.batch_size} must be a positive integer")
    if t.physical_batch_size is not None:
        if t.physical_batch_size <= 0:
            raise ConfigError("train.physical_batch_size", f"{t.physical_batch_size} must be positive")
        if t.physical_batch_size > t.batch_size:
            raise ConfigError("train.physical_batch_size", f"{t.physical_batch_size} is larger than "
                              f"train.batch_size={t.batch_size}; allowed: 1..train.batch_size")
    if not 0 <= t.lr < math.inf:
        raise ConfigError("train.lr", f"{t.lr} must be a finite number >= 0")
    if t.checkpoint_every < 0:
        raise ConfigError("train.checkpoint_every", f"{t.checkpoint_every} must be >= 0 (0 = no checkpoints)")
    if t.eval_every < 0:
        raise ConfigError("train.eval_every", f"{t.eval_every} must be >= 0 (0 = only at the end)")
    if t.eval_batch_size is not None and t.eval_batch_size <= 0:
        raise ConfigError("train.eval_batch_size", f"{t.eval_batch_size} must be positive")
    if t.compile_backend not in ("inductor", "aot_eager", "eager"):
        raise ConfigError("train.compile_backend", f"{t.compile_backend!r}: allowed inductor, aot_eager, eager")
    if t.precision == Precision.tf32 and t.device == Device.cpu:
        raise ConfigError("train.precision", "tf32 is a mode of CUDA GPUs' matmuls; allowed on cpu: fp32, bf16")
    hidden, heads = cfg.model.arch.get("hidden_size"), cfg.model.arch.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads:
        # older transformers' Llama took hidden // heads dimensions per head and dropped the rest
        raise ConfigError("model.arch.num_attention_heads", f"{heads} heads do not divide hidden_size={hidden}; "
                          f"allowed: a divisor of {hidden}")
    if cfg.logging.every < 1:
        raise ConfigError("logging.every", f"{cfg.logging.every} must be a positive number of steps")
    if not 0 < cfg.data.test_fraction < 1:
        raise ConfigError("data.test_fraction", f"{cfg.data.test_fraction}: the held-out share, allowed 0 < x < 1")
    p = cfg.privacy  # its own values; how they fit each other and the method: dpmem.privacy.calibrate.check
    if p.epsilon is not None and not 0 < p.epsilon < math.inf:
        raise ConfigError("privacy.epsilon", f"{p.epsilon} must be a finite number > 0 (or null for non-private)")
    sigma = p.get("noise_multiplier")
    if sigma is not None and (isinstance(sigma, bool) or not 0 < sigma < math.inf):
        raise ConfigError("privacy.noise_multiplier", f"{sigma} must be a finite number > 0 (σ = 0 adds no noise: "
                          "privacy=none for a non-private run)")
    if accounted(p):
        resolve_delta(p.delta, n=2)  # the form is checked here; '1/n' is resolved once n is known
    for key in ("loss_bound", "loss_noise"):
        if not 0 < p[key] < math.inf:
            raise ConfigError(f"privacy.{key}", f"{p[key]} must be a finite number > 0")
    users = cfg.data.get("users")
    if users is not None and (isinstance(users, bool) or users < 1):
        raise ConfigError("data.users", f"{users}: the number of users to give the records to, a positive integer")
    d = p.rc_dimension
    if d not in ("model", "max_layer") and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
        raise ConfigError("privacy.rc_dimension", f"{d!r}: allowed model, max_layer or a positive integer")
    if (sp := cfg.get("spectrum")) is not None:
        for key in ("top", "chunk", "k"):
            if sp[key] < 1:
                raise ConfigError(f"spectrum.{key}", f"{sp[key]} must be a positive integer")
        if sp.iterations < 0:
            raise ConfigError("spectrum.iterations", f"{sp.iterations} must be >= 0")
        if not sp.steps or min(sp.steps) < 1:
            raise ConfigError("spectrum.steps", f"{list(sp.steps)}: 1-based step numbers, e.g. [1]")
    if (mem := cfg.get("memory")) is not None:
        if mem.steps < 2:
            raise ConfigError("memory.steps", f"{mem.steps}: at least 2 (the first creates the optimiser state)")
        if not mem.allocator_overhead >= 0:
            raise ConfigError("memory.allocator_overhead", f"{mem.allocator_overhead} must be >= 0 (a fraction)")
