"""The one owner of run.dir's files (pure Python; launcher and ranks): paths, atomic writes, events, the
lock, resume requests, secrets, config files, metrics reading."""
