"""The planner: parameter counts and FLOPs (model_size), memory per GPU (memory), the plan of one layout
(estimate: bubble, communication, step-time prediction, the plan table) and validation (validate).

Pure Python: no torch, and nothing from launcher.slurm (a 64-point sweep plans in about a second)."""
