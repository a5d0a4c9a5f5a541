"""Managing runs that exist: status, logs, cancel, report, progress, resume, runs/latest."""
