"""meshrun's Hydra sweeper and launcher: compose once per set of config-group choices, not per point.

Lives under the `hydra_plugins` namespace package because Hydra only instantiates plugins from there
(hydra/core/plugins.py). Selected in conf/config.yaml (`hydra/sweeper: meshrun`, `hydra/launcher: meshrun`);
`hydra/sweeper=basic hydra/launcher=basic` on the command line restores Hydra's own.
"""
