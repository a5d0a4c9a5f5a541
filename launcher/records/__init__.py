"""A run's record, read and written by every launcher part: the readers of events.jsonl, metrics.jsonl,
checkpoints/latest and the cancel mark (readers.py), the goodput accounting (goodput.py) and a sweep point's
point.json (point.py).

A floor below manage/ and slurm/: it imports only training/contract and the checkpoint package's torch-free
storage module, so the Slurm epilogue and the status action read a run the same way without importing each other.
"""
