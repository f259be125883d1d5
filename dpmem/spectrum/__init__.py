"""`dpmem spectrum`: how the singular values of gradients decay, and what clipping and noise do to that decay, in
mode=layer (`dpmem.spectrum.layer`) or mode=trajectory (`dpmem.spectrum.trajectory`)."""

from __future__ import annotations

from pathlib import Path

from dpmem.config import ConfigError, enum_value
from dpmem.spectrum.not_private import NOT_PRIVATE


def run_spectrum(cfg, out: Path) -> tuple[dict, str]:
    """Measure (and for trajectory, train) into `out`; returns the numbers and the markdown summary."""
    from dpmem.engine.trainer import resolve_device
    from dpmem.report import spectrum as report
    from dpmem.spectrum.layer import run_layer_mode
    from dpmem.spectrum.trajectory import analyse, record

    mode = enum_value(cfg.spectrum.mode)
    for key, what in (("params", "the parameters a trajectory records"), ("gradients", "a trajectory to reanalyse")):
        if mode == "layer" and cfg.spectrum[key] is not None:  # else silently ignored
            raise ConfigError(f"spectrum.{key}", f"is mode=trajectory's ({what}); mode=layer measures the layers "
                              "spectrum.layers names (fnmatch patterns of module names), or give mode=trajectory")
    out.mkdir(parents=True, exist_ok=True)
    if mode == "layer":
        result = run_layer_mode(cfg, out)
    else:
        if cfg.spectrum.gradients is not None:
            mode = "reanalysis"
            folder = Path(cfg.spectrum.gradients).expanduser()
            folder = folder / "gradients" if (folder / "gradients").is_dir() else folder
        else:
            run, folder = record(cfg, out)
            if isinstance(run.exception, KeyboardInterrupt):
                pass  # Ctrl-C ends the recording early: what it recorded is analysed
            elif run.exception is not None:  # a failure, or SIGTERM
                raise run.exception
            elif run.summary["status"] != "ok":
                raise ConfigError("spectrum", f"the recording run ended {run.summary['status']}: "
                                  f"{run.summary.get('error')}")
        result = analyse(folder, cfg.spectrum, out, resolve_device(enum_value(cfg.train.device)))
    result.update(private=False, not_private_because=NOT_PRIVATE[mode])
    return result, report.write(out, result)
