"""Which GPU a sweep's job trains on, when a Hydra launcher runs several jobs at once on one machine.

joblib's workers inherit every GPU, and submitit_local gives every job the same CUDA_VISIBLE_DEVICES (the first
`gpus_per_node` devices: submitit's LocalExecutor._submit_command), so without a choice here every job would
train on GPU 0. SLURM jobs (submitit_slurm) are given their own GPU by the scheduler, and the basic launcher runs
one job at a time: both are left alone."""

from __future__ import annotations

CONCURRENT_LOCAL = frozenset({
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
})


def job_gpu(launcher_target: str, job_num: int, device_count: int) -> int | None:
    """The GPU index job `job_num` of a sweep should use, or None to leave the default. `device_count`, what the job
    sees (CUDA_VISIBLE_DEVICES honoured): 0 or 1 means nothing to choose (a job restricted to one device)."""
    return job_num % device_count if launcher_target in CONCURRENT_LOCAL and device_count > 1 else None


def place_job(launcher_target: str, job_num: int, device: str) -> None:
    """Make torch.device("cuda") mean this job's GPU (see job_gpu), for a run on `device` (train.device)."""
    if device not in ("auto", "cuda"):
        return  # a CPU run: set_device would create a CUDA context for nothing
    import torch

    gpu = job_gpu(launcher_target, job_num, torch.cuda.device_count())
    if gpu is not None:
        torch.cuda.set_device(gpu)


def cuda_device_count() -> int:
    """Every GPU of this machine, for submitit_local's gpus_per_node (conf/hydra/launcher/local.yaml): each job
    then sees them all, and place_job picks its own."""
    import torch

    return torch.cuda.device_count()
