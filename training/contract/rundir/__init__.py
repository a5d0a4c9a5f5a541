"""run.dir's files (pure Python; launcher and ranks): the map naming each of them (paths.py, RunPaths), atomic and
durable writes (files.py, with the list of top-level run files checked for links), config files, events, the lock,
resume requests, secrets, metrics reading."""
