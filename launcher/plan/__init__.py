"""The planner: parameter counts and FLOPs (model_size), memory per GPU (memory), the plan of one layout
(estimate: bubble, communication, step-time prediction, the plan table) and validation (validate).

Pure Python: no torch, nothing from the rest of launcher/, nothing read from the machine (the launch gate checks
that: launcher/launch/host_checks.py); a 64-point sweep plans in about a second."""
