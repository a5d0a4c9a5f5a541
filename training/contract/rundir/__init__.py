"""The one owner of run.dir's files (pure Python; launcher and ranks): atomic and durable writes (files.py, with the
list of run files), config files, events, the lock, resume requests, secrets, metrics reading."""
