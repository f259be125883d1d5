"""What `dpmem --help` prints, and the page of the documentation each verb's --help points to."""

USAGE = """usage: dpmem train [-m] [key=value ...]
       dpmem memory [key=value ...]
       dpmem plan [key=value ...]
       dpmem check [key=value ...]
       dpmem spectrum mode=layer|trajectory [key=value ...]
       dpmem audit [key=value ...]
       dpmem report PATH... [--out DIR] [--published] [--select top3] [--holder]

  dpmem train                                      the embedded default (ViT on digits, grape, eps=8)
  dpmem train method=adam privacy=none             a non-private baseline
  dpmem train -m method=dp-adam,grape privacy=eps2,eps8  a sweep (one run folder each)
  dpmem train --help                               every config group and option
  dpmem train --help privacy                       one group's keys, values and presets
  torchrun --nproc_per_node=2 -m dpmem train ...   one run data-parallel over 2 processes (GPUs)
  dpmem memory model=opt-6.7b data=synthetic method=dp-adam,grape train.batch_size=1,2,4
                                                   plan peak memory on the meta device (no weights)
  dpmem memory model=vit-base data=synthetic method=dp-adam,grape memory.budget=24GB
                                                   the largest batch that fits, per method
  dpmem plan model=roberta-large data=synthetic memory.budget=24GB plan.device=l4
                                                   the fastest configuration that fits a GPU (estimated)
  dpmem check model=auto model.pretrained=gpt2 data=sst2
                                                   each layer's rule and the attribution proof, on the CPU
  dpmem spectrum mode=layer spectrum.clip=[null,1.0] spectrum.sigma=[0,0.5,2.0]
                                                   singular values of each layer's (clipped, noised) gradient
  dpmem spectrum mode=trajectory method=dp-adam    PCA of a private run's clipped gradients, and subspace.pt
  dpmem audit method=dp-adam,grape privacy=eps2 audit.canaries=1000
                                                   one run each with m canaries: an empirical lower bound on epsilon
  dpmem report outputs/multirun/DATE               the runs' summaries as tables (method x epsilon, tasks)

Documentation (Markdown in the repository's docs/; `mkdocs serve` shows it as a site):
  docs/getting-started.md   install, a run and its folder, configuration, sweeps, dpmem report
  docs/tutorial.md          one task end to end: a private run, its epsilon, accuracy against epsilon, memory
  docs/configuration.md     every key of every group, its default and what it does
  docs/opacus.md            coming from Opacus: its names mapped to dpmem's, the same loop written with each
  docs/models.md            bring your own model: which rule covers each layer, the attribution proof, model=auto
  docs/run-folders.md       what a run writes, exit codes and statuses, resuming, the ledger of epsilon
  docs/faq.md               when something fails: a run that does not learn, out of memory, hub errors offline
  docs/scale.md             torchrun, FSDP, Hydra's launchers, SLURM, the Optuna search
  docs/methods.md           the private step, clipping modes, each method, precision, train.compile
  docs/memory.md            dpmem memory: planned peaks, budgets, the largest batch that fits
  docs/plan.md              dpmem plan: choosing a configuration for a GPU
  docs/privacy.md           accounting, secret seeds, what a run releases, the ledger, dpmem audit
  docs/sharp-edges.md       DP pitfalls: what dpmem guards against and what it cannot
  docs/reproductions.md     the papers' experiments (experiment=...), dpmem spectrum
  docs/api.md               the Python API for a training loop of your own
"""
VERB_DOCS = {"train": "docs/getting-started.md", "memory": "docs/memory.md", "plan": "docs/plan.md",
             "check": "docs/models.md",
             "spectrum": "docs/reproductions.md", "audit": "docs/privacy.md", "report": "docs/getting-started.md"}
