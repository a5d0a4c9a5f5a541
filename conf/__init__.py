"""meshrun's Hydra config tree, installed as the package `meshrun_conf` (pyproject.toml maps it to conf/).

A package so that Hydra finds the presets through the installed distribution (`pkg://meshrun_conf`),
wherever meshrun is installed; the groups below are plain folders of YAML presets.
"""
