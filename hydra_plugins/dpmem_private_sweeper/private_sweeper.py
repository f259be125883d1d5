"""The Hydra side of a private search: draw K and the trials (dpmem.engine.selection), launch them with the
configured launcher, score them, and write what is released."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import OmegaConf


class PrivateSweeper(Sweeper):
    def __init__(self, mean_trials: float, shape: Any, params: Any = None):
        self.mean_trials, self.shape = mean_trials, shape
        self.params = OmegaConf.to_container(params, resolve=False) if params is not None else None
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from dpmem.engine.selection import SearchState, finish, parse_space, plan_search, trial_overrides

        fixed, dims = parse_space(arguments, self.params)
        search = plan_search(self.config, self.mean_trials, self.shape, arguments)
        folder = Path(self.config.hydra.sweep.dir)
        folder.mkdir(parents=True, exist_ok=True)
        state = SearchState(folder, search, fixed, dims)
        batch = [trial_overrides(search, fixed, state.point(i, dims)) for i in range(state.trials)]
        returns = []
        if batch:
            self.validate_batch_is_legal(batch)
            returns = self.launcher.launch(batch, initial_job_idx=0)
        results = []
        for r in returns:
            score = r.return_value if r.status == JobStatus.COMPLETED else None
            results.append((Path(r.hydra_cfg.hydra.runtime.output_dir), score))
        record = finish(folder, search, results)
        print(f"dpmem: private search ended ({record['ended']}): release {record['winner'] or 'nothing'} at "
              f"ε = {record['epsilon']:g}, δ = {record['delta']:.3g} ({folder / 'selection.json'})", file=sys.stderr)
        return [score for _, score in results]
