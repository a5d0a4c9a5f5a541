"""The torch-free contract launcher and ranks share: config, exit codes, layout rules, the run directory."""
