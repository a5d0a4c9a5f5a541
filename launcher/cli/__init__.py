"""The `meshrun` command line: the Hydra app, its schema, key listing and command-line secrets."""
