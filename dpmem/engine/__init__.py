"""The run engine: `assemble` (model → checkpointing → sharding → noise → method, for every tool), `trainer` (the
step loop), `planner` (peak memory on the meta device), and the run folder's parts (folder, checkpoint, ledger,
summary, meter, tracking, placement)."""
