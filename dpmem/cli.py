"""`dpmem VERB [hydra overrides]`: one Hydra app per verb, kept thin. The overrides are composed first
(`dpmem.composition`), so a bad value ends in one line, exit 2 (`debug=true` shows the traceback instead)."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

from dpmem import distributed
from dpmem.composition import (ABSENT, CONF_DIR, compose_points, error, group_options, labels, select,
                               sweep_points)
from dpmem.config import ConfigError, enum_value
from dpmem.engine import job
from dpmem.engine.folder import check_output, given
from dpmem.engine.job import run_job
from dpmem.engine.search import preflight
from dpmem.usage import USAGE, VERB_DOCS


@hydra.main(config_path=CONF_DIR, config_name="config", version_base=None)
def _train(cfg: DictConfig) -> float:
    return run_job(cfg)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return
    verb, rest = argv[0], argv[1:]
    if verb not in ("train", "report") and distributed.launched():
        raise error(f"dpmem {verb} runs in one process; only dpmem train runs under torchrun")
    tools = {"memory": _memory, "plan": _plan, "check": _check, "spectrum": _spectrum, "audit": _audit,
             "report": _report}
    if verb in tools and any(a in ("-h", "--help") for a in rest):  # the usage, and the page of the docs about it
        print(USAGE + f"\ndpmem {verb}: {VERB_DOCS[verb]}\n", end="")
        return
    if verb in tools:  # the verbs but report sweep comma lists themselves (or take one setting): -m is implied
        return tools[verb](rest if verb == "report" else [a for a in rest if a not in ("-m", "--multirun")])
    if verb != "train":
        raise error(f"unknown command {verb!r}; allowed: train, {', '.join(tools)}")
    distributed.init_from_env()
    try:
        _train_main(rest)
        distributed.settle()
    finally:
        distributed.close()


def _train_help(rest: list[str]) -> None:
    """`dpmem train [overrides] --help [GROUP ...]`: the config groups users choose from (not the schemas dpmem
    registers for validation, which Hydra's help would list) and the config the overrides compose; with GROUP (a
    bare word: privacy, or a key such as privacy.delta), that part of it alone."""
    args = [a for a in rest if a not in ("-h", "--help", "-m", "--multirun")]
    words = [a for a in args if re.fullmatch(r"[A-Za-z_][\w.-]*", a)]  # no '=': a group or key to show
    with _one_line_errors(rest):
        cfg = compose_points(sweep_points([a for a in args if a not in words])[:1])[0]
        if words:
            return _group_help(cfg, words)
    lines = [USAGE.splitlines()[0].replace("usage: ", ""), "",
             f"Documented in {VERB_DOCS['train']} (running), docs/methods.md (methods and their options) and "
             "docs/privacy.md (privacy.*); dpmem train --help GROUP (e.g. privacy) shows one group's keys", "",
             "== Configuration groups ==", "Compose your configuration from those groups (group=option)", ""]
    lines += [f"{where}: {', '.join(names)}" for where, names in sorted(group_options().items())]
    lines += ["", "== Config ==", "Override anything in the config (foo.bar=value)", "", OmegaConf.to_yaml(cfg)]
    print("\n".join(lines), end="")


def _group_help(cfg: DictConfig, words: list[str]) -> None:
    """`dpmem train --help privacy`: each named group's (or key's) composed values, its presets, and where each key's
    meaning is. Raises ConfigError for a name the config does not have."""
    for word in words:
        if select(cfg, word) is ABSENT:
            raise ConfigError(word, "no such group or key of the config; allowed a group ("
                              f"{', '.join(k for k in cfg if isinstance(cfg[k], DictConfig))}) or a key in one, e.g. "
                              "dpmem train --help privacy")
    lines = []
    for word in words:
        group, node = word.split(".")[0], select(cfg, word)
        anchor = group if isinstance(cfg[group], DictConfig) else "top-level"
        lines += [f"== {word} ==", f"What each key means, its type and default: docs/configuration.md#{anchor}"]
        if word in group_options():
            lines.append(f"Presets ({word}=NAME): {', '.join(group_options()[word])}")
        body = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else f"{word}: {node}\n"
        lines += ["", body]
    print("\n".join(lines), end="")


def _train_main(rest: list[str]) -> None:
    if any(a in ("-h", "--help") for a in rest):
        return _train_help(rest)
    if not any(a in ("--hydra-help", "--info", "-i", "-c") or a.startswith("--cfg") for a in rest):  # (-h: above)
        with _one_line_errors(rest):
            preflight(rest)
            if distributed.is_main():
                key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in rest) else "hydra.run.dir"
                name = given(rest, key)
                check_output(key, "outputs" if name is None else name)
    if not distributed.is_main():  # rank 0 alone speaks for Hydra (and writes the run folder)
        rest = rest + ["hydra/hydra_logging=none"]
    sys.argv = [f"{Path(sys.argv[0]).name} train"] + rest
    try:
        _train()
    except KeyboardInterrupt:  # between a sweep's runs (within one, the run records it and exits 130 itself)
        print("dpmem: interrupted (Ctrl-C); the same command with its hydra.sweep.dir and train.skip_done=true goes "
              "on: what finished is skipped, what has a checkpoint resumes", file=sys.stderr)
        raise SystemExit(130) from None
    if job.failed:
        raise error(f"{len(job.failed)} run(s) did not finish ok: {', '.join(job.failed)}")


@contextlib.contextmanager
def _one_line_errors(args: list[str]):
    """A ConfigError ends the command with one line (exit 2); debug=true among `args` shows its traceback instead."""
    try:
        yield
    except ConfigError as e:
        if any(a.lower() in ("debug=true", "debug=1") for a in args):
            raise
        raise error(str(e)) from None


CHECK_SAMPLES = 4  # the training samples `dpmem check` proves on: a few do (the proof is exact at any batch > 1)


def _check(overrides: list[str]) -> None:
    """`dpmem check`: one configuration's model and data built on the CPU and checked on its first training samples
    (`dpmem.api.check`): which rule forms each module's per-sample gradients, the attribution proof under every
    clipping plan, each plan's step memory measured; then the run's peak as `dpmem memory` plans it, at its batch
    size on its memory.device. A layer no rule covers, or anything that mixes samples, ends in one line (exit 2).
    Nothing is trained or released; no folder is written."""
    from dpmem.checking import check
    from dpmem.data import build_data
    from dpmem.engine.planner import plan
    from dpmem.models import build_model

    with _one_line_errors(overrides):
        points = sweep_points(overrides)
        if len(points) > 1:
            raise ConfigError("overrides", f"dpmem check takes one configuration, not a sweep of {len(points)}")
        cfg = compose_points(points)[0]
        data = build_data(cfg.data, cfg.model)
        model = build_model(cfg.model, data).train()
        batch = data.batch(data.train, slice(0, CHECK_SAMPLES))
        try:
            found = check(model, data.per_sample_loss, batch)
        except (ValueError, RuntimeError) as e:
            raise error(f"check: {cfg.model.name}: {e}") from None
        del model, data  # the plan builds its own, on memory.device
        planned = plan(cfg)
    gib = lambda part: f"{part['peak_bytes'] / 2**30:.3f}"  # noqa: E731
    batch = planned["batch_size"]
    print(f"dpmem check: {cfg.model.name} on {CHECK_SAMPLES} samples of {cfg.data.name}\n\n{found}\n\n"
          f"The run as configured ({cfg.method.name}, B={batch}, physical {cfg.train.physical_batch_size or batch}), "
          f"planned on {enum_value(cfg.memory.device)} as dpmem memory plans it: peak {gib(planned)} GiB (training "
          f"{gib(planned['training'])}, evaluation {gib(planned['evaluation'])})")


def _memory(overrides: list[str]) -> None:
    """`dpmem memory`: plan every point of the sweep (comma lists, with or without -m) into one folder."""
    from dpmem.engine.folder import tool_dir, tool_folder
    from dpmem.engine.planner import SEARCH_LIMIT, largest_batch, parse_bytes, plan
    from dpmem.report import memory as report

    with _one_line_errors(overrides), contextlib.ExitStack() as held:
        points = sweep_points(overrides)
        cfgs = compose_points(points)
        names = labels(points, cfgs, skip="train.batch_size=")
        mem = cfgs[0].memory
        out, key = tool_dir(overrides, "memory.dir", mem.dir, "outputs/memory/%Y-%m-%d/%H-%M-%S")
        held.enter_context(tool_folder(out, "memory", cfgs[0].train.overwrite, key))
        rows, found = [], None
        if mem.budget is None:
            for label, cfg in zip(names, cfgs):
                rows.append(row := {"label": label, **plan(cfg)})
                print(f"dpmem memory: {label} B={row['batch_size']}: peak {row['peak_bytes'] / 2**30:.2f} GiB "
                      f"(training {row['training']['peak_bytes'] / 2**30:.2f}, evaluation at B="
                      f"{row['evaluation']['batch_size']} {row['evaluation']['peak_bytes'] / 2**30:.2f})",
                      file=sys.stderr)
        else:
            budget, found = parse_bytes(mem.budget), []
            for label in dict.fromkeys(names):  # batch sizes are searched, not taken from the overrides
                batch, at = largest_batch(cfgs[names.index(label)], budget)
                capped = batch >= SEARCH_LIMIT
                found.append({"label": label, "largest_batch": batch, "capped": capped, "plan": {"label": label, **at}})
                print(f"dpmem memory: {label}: largest batch {batch}" + (
                    " (where the search stops: larger batches fit too)" if capped else ""), file=sys.stderr)
        text = report.write(out, rows, mem.budget, found)
    print(text, end="")
    print(f"dpmem memory: wrote {', '.join(sorted(f.name for f in out.iterdir() if not f.name.startswith('.')))} "
          f"to {out}", file=sys.stderr)


def _plan(overrides: list[str]) -> None:
    """`dpmem plan`: the candidates of one setting, planned, timed and ranked into one folder."""
    from dpmem.engine.chooser import check_reachable, choose, host_memory, nothing_fits
    from dpmem.engine.folder import mark, tool_dir, tool_folder
    from dpmem.engine.planner import parse_bytes
    from dpmem.engine.roofline import device as plan_device
    from dpmem.report import plan as report

    with _one_line_errors(overrides), contextlib.ExitStack() as held:
        if len(sweep_points(overrides)) > 1:
            raise ConfigError("override", "dpmem plan plans one setting (no comma lists): the configurations it "
                              "compares are plan.candidates × plan.checkpointing × plan.precisions")
        cfg = compose_points([overrides])[0]
        pc = cfg.plan
        device = plan_device(enum_value(pc.device))
        budget = parse_bytes(cfg.memory.budget) if cfg.memory.budget is not None else (
            int(device.memory_gib * 2**30) if device.name != "cpu" else host_memory())
        if enum_value(cfg.memory.device) != "meta" or cfg.memory.world_size != 1:
            raise ConfigError("memory.device" if enum_value(cfg.memory.device) != "meta" else "memory.world_size",
                              "dpmem plan plans one GPU on meta (memory.device=meta, memory.world_size=1); the GPU "
                              "it plans for is plan.device")
        check_reachable(cfg)
        out, key = tool_dir(overrides, "plan.dir", pc.dir, "outputs/plan/%Y-%m-%d/%H-%M-%S")
        held.enter_context(tool_folder(out, "plan", cfg.train.overwrite, key))
        # the GPU's plan counts CUDA's allocation blocks and kernels; the cpu's exact bytes and the CPU's kernels
        target = ["memory.target=cpu"] if device.name == "cpu" else ["memory.target=cuda"]
        result = choose(lambda extra: compose_points([[*overrides, *target, *extra]])[0], overrides, budget, device)
        fitting = [r for r in result["rows"] if r["fits"]]
        if result["interrupted"]:  # Ctrl-C: what was planned is kept, as train keeps its run
            if fitting:
                mark(out, "plan")
                report.write(out, result, overrides, pc.top)
            print(f"dpmem plan: interrupted after {len(result['rows'])} planned candidate(s)"
                  + (f"; wrote them to {out}" if fitting else "; none fitted, nothing written"), file=sys.stderr)
            raise SystemExit(130)
        if not fitting:
            raise nothing_fits(result["rows"], budget)
        text = report.write(out, result, overrides, pc.top)
    print(text, end="")
    print(f"dpmem plan: wrote {', '.join(sorted(f.name for f in out.iterdir() if not f.name.startswith('.')))} "
          f"to {out}", file=sys.stderr)


def _audit(overrides: list[str]) -> None:
    """`dpmem audit`: each sweep point trained with canaries into its own folder, and one table of the bounds."""
    from dpmem.audit import check, check_room, run_audit, table
    from dpmem.engine.folder import check_owner, mark, tool_dir, tool_folder
    from dpmem.report.labels import file_name

    records = []
    with _one_line_errors(overrides), contextlib.ExitStack() as held:
        points = sweep_points(overrides)
        cfgs = compose_points(points)
        names = labels(points, cfgs)
        for cfg in cfgs:  # every point's settings before any folder is written
            check(cfg)
            check_room(cfg)
        out, key = tool_dir(overrides, "audit.dir", cfgs[0].audit.dir, "outputs/audit/%Y-%m-%d/%H-%M-%S")
        folders = [out if len(cfgs) == 1 else out / file_name(label) for label in names]
        for folder, cfg in zip(folders, cfgs):  # each point's folder too, before any is written
            if folder != out:
                check_owner(folder, "audit", cfg.train.overwrite, key)
        held.enter_context(tool_folder(out, "audit", cfgs[0].train.overwrite, key, mark_first=True))
        for label, cfg, folder in zip(names, cfgs, folders):
            mark(folder, "audit")
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            record, _ = run_audit(cfg, folder)
            records.append(record)
            print(f"dpmem audit: {label}: claimed epsilon {record['epsilon_claimed']:.3g}, audited epsilon >= "
                  f"{record['epsilon_lower_bound']:.3f} ({record['correct']}/{record['guesses']} guesses right)",
                  file=sys.stderr)
        text = table(records)
        if len(records) > 1:
            (out / "audit.md").write_text(text)
    print(text, end="")
    print(f"dpmem audit: wrote {out}/audit.md", file=sys.stderr)


def _spectrum(overrides: list[str]) -> None:
    """`dpmem spectrum`: one configuration (the C and sigma lists are swept inside), into one folder."""
    from dpmem.engine.folder import tool_dir, tool_folder
    from dpmem.spectrum import run_spectrum

    overrides = [("spectrum." + a) if a.startswith("mode=") else a for a in overrides]  # mode= for spectrum.mode=
    with _one_line_errors(overrides):
        points = sweep_points(overrides)
        if len(points) > 1:
            raise ConfigError("override", "dpmem spectrum takes one configuration (no comma lists); the settings "
                              "it compares are lists: spectrum.clip=[null,1.0] spectrum.sigma=[0,0.5,2.0]")
        (cfg,) = compose_points(points)
        mode = cfg.spectrum.mode.value
        out, key = tool_dir(overrides, "spectrum.dir", cfg.spectrum.dir, f"outputs/spectrum/%Y-%m-%d/%H-%M-%S_{mode}")
        with tool_folder(out, "spectrum", cfg.train.overwrite, key, mark_first=True):
            (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            _, text = run_spectrum(cfg, out)
    print(text, end="")
    print(f"dpmem spectrum: wrote {out}/spectrum.json", file=sys.stderr)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise error(f"dpmem report: {message} (usage: {self.format_usage().strip()[7:]})")


def _report(argv: list[str]) -> None:
    """`dpmem report`: tables of every summary.json under the paths."""
    from dpmem.report import runs

    ap = _OneLineParser(prog="dpmem report", add_help=False)
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, help="the folder the report goes to (default: PATH/report)")
    ap.add_argument("--published", action="store_true", help="the papers' numbers beside the runs'")
    ap.add_argument("--select", choices=["top3"], help="the best metric of the three lowest training losses")
    ap.add_argument("--holder", action="store_true", help="a private search's every trial, not its release alone "
                    "(tells K: not for release)")
    args = ap.parse_args(argv)
    if not args.paths:
        raise error("dpmem report needs the run folders to tabulate: dpmem report PATH... (e.g. dpmem report "
                    "outputs/multirun/DATE)")
    try:
        summaries, missing = runs.collect(args.paths)
    except FileNotFoundError as e:
        raise error(str(e)) from None
    if not summaries and not missing:
        raise error(f"no summary.json under {', '.join(map(str, args.paths))}")
    out = args.out or args.paths[0] / ("holder-report" if args.holder else "report")
    if out.exists() and not out.is_dir():
        raise error(f"--out {out} is a file: give the folder the report goes to")
    try:
        print(runs.write(out, summaries, missing, args.published, args.select, args.holder), end="")
    except OSError as e:  # a read-only run folder (the default output is inside it), a full disk
        raise error(f"cannot write the report into {out} ({e.strerror or type(e).__name__}): give a folder you can "
                    "write with --out DIR") from None
    print(f"dpmem report: wrote {out}/report.md, report.csv, report.tex", file=sys.stderr)


if __name__ == "__main__":
    main()
