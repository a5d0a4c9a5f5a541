"""The layout search: action=recommend's ranking of every valid layout by predicted step time (recommend), and
parallel=auto's choice of the fastest layout that fits (auto, auto_search), which an elastic Slurm job also asks
again at each node count. Pure planning over launcher/plan/: it launches nothing (the recommend action's runs of
its top candidates are launcher/launch/calibrate.py's)."""
